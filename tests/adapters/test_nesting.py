"""`check_nesting`: brackets outside strings only (escaped quotes and backslashes in strings followed), across the
chunks it reads, naming the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shapeplan.adapters import data
from shapeplan.errors import DatasetError


def test_only_brackets_outside_strings_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "MAX_NESTING", 5)
    deep = "[" * 6 + "]" * 6
    rows = [{"text": deep}, {"text": 'a \\" ' + deep}, {"text": "a \\\\", "x": [[1]]}, {"x": [[[[1]]]]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data.check_nesting(path)  # five levels at most outside the strings (the row object is one)
    path.write_text(path.read_text() + json.dumps({"x": json.loads(deep)}) + "\n")
    with pytest.raises(DatasetError, match="levels deep on line 5"):
        data.check_nesting(path)
