"""The package root shows the flow: the public API, `errors` and folders, each folder a layer of the import-linter
contract that `make lint` checks (docs/architecture.md), so a new folder or a loose module cannot escape it."""

from __future__ import annotations

import subprocess
import sys

import tomllib

from tests.conftest import ROOT

PACKAGE = ROOT / "shapeplan"


def _layers() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return {name.strip() for layer in contract["layers"] for name in layer.split("|")}


def test_the_root_holds_no_loose_module() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "errors.py"], "put a service into shapeplan/services/"


def test_every_folder_and_module_of_the_root_is_a_layer() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert _layers() == folders | {"errors"}


def test_no_module_imports_one_that_imports_it() -> None:
    """No import cycle between any two modules, a package and its own modules included (the linter's sibling
    contract does not see those), imports inside functions counted."""
    import grimp

    graph = grimp.build_graph("shapeplan", cache_dir=None)
    cycles = sorted((module, imported) for module in graph.modules
                    for imported in graph.find_modules_directly_imported_by(module)
                    if graph.find_shortest_chain(importer=imported, imported=module))
    assert cycles == []


def test_the_public_api_is_the_root_and_importing_it_stays_light() -> None:
    """`import shapeplan` names the plan types, `analyze`, `analyze_script`, `ShapeGuard`, `pad_tool_turns` and
    `resize_images` without importing TRL, torch or the services; `shapeplan.analyze` is the service the CLI's
    `analyze` runs."""
    code = ("import sys, shapeplan\n"
            "light = sorted(n for n in ('torch', 'trl', 'transformers', 'datasets', 'shapeplan.services') "
            "if n in sys.modules)\n"
            "from shapeplan.services.analyze import analyze\n"
            "print(light, shapeplan.analyze is analyze, sorted(set(shapeplan.__all__) - set(dir(shapeplan))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lazy = "['ShapeGuard', 'analyze', 'analyze_script', 'pad_tool_turns', 'resize_images']"
    assert (result.returncode, result.stdout) == (0, f"[] True {lazy}\n"), result.stderr
