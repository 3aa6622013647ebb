"""The analyze benchmark runs end to end on a few rows, so `make bench` keeps working."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks import benchmark

pytestmark = pytest.mark.slow


def test_benchmark_runs_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    analyze_speed = benchmark("analyze_speed")
    out = tmp_path / "results.json"
    assert analyze_speed.main(["--rows", "24", "--kinds", "conversational", "--parts", "floor,analyze,cached",
                               "--json", str(out)]) == 0
    results = json.loads(out.read_text())["conversational"]
    assert list(results) == ["floor", "analyze", "cached"]
    assert results["cached"]["shapes"] == results["analyze"]["shapes"]  # the cached re-run plans the same shapes
    assert "analyze" in capsys.readouterr().out
