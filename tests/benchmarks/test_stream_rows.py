"""The streaming benchmark runs end to end on small streams, so `make bench` keeps working, and what it measures
holds there too: planning reads the rows the run consumes, whatever the stream's size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks import benchmark

pytestmark = pytest.mark.slow


def test_benchmark_runs_small(tmp_path: Path) -> None:
    stream_rows = benchmark("stream_rows")
    out = tmp_path / "results.json"
    assert stream_rows.main(["--sizes", "3000,6000", "--steps", "4", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    for rows in (3000, 6000):
        assert results[f"stream@{rows}"]["rows_read"] == 32  # 4 steps x batch 8
        assert results[f"stream-packing@{rows}"]["rows_read"] == 1000  # one pack batch of TRL's holds 32 packed rows
