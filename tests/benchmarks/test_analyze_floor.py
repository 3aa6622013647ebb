"""The floor benchmark runs end to end on a few rows, so `make bench` keeps working; and the process of a command
ends as the interpreter ends it (what the benchmarks time of it), without the interpreter's teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks import benchmark
from tests.conftest import ROOT

# Before the command: an exit handler and a thread the interpreter waits for (an executor's pending work), each
# leaving a file; then the command, as the `shapeplan` entry point runs it.
SCRIPT = """
import atexit, concurrent.futures, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
atexit.register(lambda: (out / "handler").write_text("ran"))
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(lambda: (time.sleep(0.3), (out / "thread").write_text("ran")))
from shapeplan.cli import main
sys.argv = ["shapeplan", *sys.argv[2:]]
sys.exit(main())
"""


@pytest.mark.parametrize("words, code, stdout", [
    (["--version"], 0, "shapeplan, version"),
    (["analyze", "--method", "nonesuch"], 2, ""),
])
def test_a_command_ends_its_process_with_its_threads_and_exit_handlers_done(
        words: list[str], code: int, stdout: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), *words], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == code, done.stderr
    assert done.stdout.startswith(stdout)
    assert (tmp_path / "handler").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "ran"


@pytest.mark.slow
def test_floor_benchmark_runs_small(tmp_path: Path) -> None:
    analyze_floor = benchmark("analyze_floor")
    out = tmp_path / "results.json"
    assert analyze_floor.main(["--rows", "", "--small", "16", "--json", str(out)]) == 0
    small = json.loads(out.read_text())["small"]
    assert small["rows"] == 16
    assert small["ratio"] > 0 and small["first_run_ratio"] > 0
