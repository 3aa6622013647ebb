"""Each method name is spelled in code once, in the trainer registry: what the code knows about a trainer is a
`TrainerSpec` field, not a comparison with its name. Docstrings, comments and messages may name methods."""

from __future__ import annotations

import ast

from shapeplan.services.trainers import METHODS
from tests.conftest import ROOT

# Where a quoted method name is the registry itself, or a value that is no trainer knowledge.
ALLOWED = {
    "shapeplan/services/trainers.py": None,  # the registry
    "shapeplan/plan/model.py": {"Method"},  # the Literal the registry's names are checked against
    "shapeplan/warm/identity.py": {"_CONFIG_SECTION"},  # a manifest key that happens to read "sft"
}


def _quoted_method_names() -> list[str]:
    found = []
    for path in sorted((ROOT / "shapeplan").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        allowed = ALLOWED.get(name, set())
        if allowed is None:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        exempt = {id(node) for stmt in tree.body if isinstance(stmt, ast.Assign | ast.AnnAssign)
                  for target in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
                  if isinstance(target, ast.Name) and target.id in allowed for node in ast.walk(stmt)}
        found += [f"{name}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in METHODS and id(node) not in exempt]
    return found


def test_method_names_are_spelled_only_in_the_registry() -> None:
    assert _quoted_method_names() == [], "make these TrainerSpec fields (shapeplan/services/trainers.py)"
