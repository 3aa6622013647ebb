"""The error classes: every ShapeplanError subclass anywhere in the package has its exit code in errors.EXIT_CODES
(as httpx checks that every httpcore exception is mapped), and SHAPEPLAN_DEBUG=1 shows the traceback behind the
one-line error."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from shapeplan import errors
from tests.conftest import ROOT

SHAPEPLAN = str(Path(sys.executable).parent / "shapeplan")


def _error_classes_in_source() -> dict[str, str]:
    """Every class in shapeplan/ that derives, directly or not, from ShapeplanError: name -> file. Read from the
    source, so a subclass in a module nothing imports yet is found too."""
    bases: dict[str, tuple[list[str], str]] = {}
    for path in sorted((ROOT / "shapeplan").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                names = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, ast.Name | ast.Attribute)]
                bases[node.name] = (names, str(path.relative_to(ROOT)))
    found = {"ShapeplanError": "shapeplan/errors.py"}
    grew = True
    while grew:
        grew = False
        for name, (parents, path) in bases.items():
            if name not in found and any(p in found for p in parents):
                found[name] = path
                grew = True
    return found


def test_every_error_class_has_its_exit_code_in_the_table() -> None:
    mapped = {cls.__name__ for cls in errors.EXIT_CODES}
    unmapped = {name: path for name, path in _error_classes_in_source().items() if name not in mapped}
    assert not unmapped, f"add these to errors.EXIT_CODES (and the README's exit-code table): {unmapped}"


def test_an_error_exits_with_its_own_code_from_the_table() -> None:
    for cls, code in errors.EXIT_CODES.items():
        assert cls("message").exit_code == code
    assert errors.CacheMismatchError("m").exit_code == 3 != errors.CacheError("m").exit_code


def _inspect_missing_archive(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SHAPEPLAN, "cache", "inspect", str(tmp_path / "missing.tar.gz")], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True,
                          timeout=120, check=False)


def test_shapeplan_debug_shows_the_traceback_behind_the_one_line_error(tmp_path: Path) -> None:
    plain = _inspect_missing_archive(tmp_path)
    assert plain.returncode == 1 and len(plain.stderr.splitlines()) == 1, plain.stderr
    debug = _inspect_missing_archive(tmp_path, SHAPEPLAN_DEBUG="1")
    lines = debug.stderr.splitlines()
    assert debug.returncode == 1 and debug.stdout == ""
    assert lines[0] == "Traceback (most recent call last):" and "CacheError" in lines[-2], debug.stderr
    assert lines[-1] == plain.stderr.strip()
