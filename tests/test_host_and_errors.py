"""The shared helpers: the one line of a foreign exception, installed versions, the cache root."""

from __future__ import annotations

from pathlib import Path

import pytest

from shapeplan.adapters.host import cache_root, installed_only, installed_versions
from shapeplan.errors import first_line


def test_first_line_keeps_the_first_line_and_names_the_type_on_request() -> None:
    error = ValueError("  bad value\nsecond line  ")
    assert first_line(error) == "bad value"
    assert first_line(error, named=True) == "ValueError: bad value"
    assert first_line(KeyError()) == "KeyError"
    assert first_line(RuntimeError(), named=True) == "RuntimeError"


def test_installed_versions_say_none_for_a_missing_package() -> None:
    missing = "shapeplan-no-such-package"
    assert installed_versions(["pytest", missing]) == {"pytest": pytest.__version__, missing: None}
    assert installed_only(["pytest", missing]) == {"pytest": pytest.__version__}


def test_the_cache_root_follows_shapeplan_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SHAPEPLAN_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.setenv("SHAPEPLAN_CACHE_DIR", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "shapeplan"
