"""2-rank warm-ups and real runs under `accelerate launch` (gloo on CPU), for the data-parallel coverage tests
(tests/warm/test_data_parallel.py, tests/warm/test_generation_data_parallel.py): each rank runs
tests/warm/dp_rank.py and leaves its record (the device-op signatures it dispatched, its compile counters) in a
pickle. The launcher and its ranks are forks of the worker's server for their environment (tests/forked_python.py
stands for `python`), which imported torch and TRL once for all of them."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from shapeplan.plan.io import write_plan
from shapeplan.plan.model import Plan
from tests import console
from tests.conftest import ROOT


def json_reports(stdout: str) -> list[dict[str, Any]]:
    """The JSON reports one after another on `stdout` (`shapeplan warm --json` of each rank or worker)."""
    decoder, reports, at = json.JSONDecoder(), [], 0
    while at < len(stdout.rstrip()):
        report, at = decoder.raw_decode(stdout, at)
        reports.append(report)
        while at < len(stdout) and stdout[at].isspace():
            at += 1
    return reports


def _env() -> dict[str, str]:
    # Inductor compiles in-process: a compile worker pool only competes for the two ranks' cores
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def _launch(spec: dict[str, Any], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    python, env = console.forked_python(env)
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)]
    rank = ["-m", "tests.warm.dp_rank", json.dumps(spec)]  # each rank: `python -m tests.warm.dp_rank SPEC`
    command = [*python, *launch, *(rank if python == [sys.executable] else [*python[1:], *rank])]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _ranks(prefix: Path) -> list[dict[str, Any]]:
    return [pickle.loads(Path(f"{prefix}.{rank}.pickle").read_bytes()) for rank in range(2)]


def warm_then_run_plan(plan: Plan, method: str, data: Path, argv: list[str], tmp_path: Path, *, device_ops: bool,
                       phases: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                         list[dict[str, Any]]]:
    """Warm the 2-rank `plan` under `accelerate launch`, checking that the ranks warmed its shapes of `phases`
    between them, each its own, none failed; then run `trl <method> ARGV` on `data` for real the same way, on the
    warmed cache and a datasets cache no warm-up writes (so that a precompute pass runs instead of reading the
    warm-up's result; the worker's real runs share it, and each test's data file is its own, which datasets keys
    its cache by). Returns each rank's warm report, warm-up record and real-run record."""
    write_plan(plan, tmp_path / "plan.json")
    env = _env()
    warmed = _launch({"mode": "warm", "out": str(tmp_path / "warm"), "device_ops": device_ops,
                      "plan": str(tmp_path / "plan.json"), "cache": str(tmp_path / "cache")}, env)
    reports = json_reports(warmed.stdout)
    assert len(reports) == 2 and all(r["environment"]["world_size"] == 2 for r in reports)
    shares = [sorted(r["key"] for r in report["results"]) for report in reports]
    assert all(shares) and not set(shares[0]) & set(shares[1])  # each rank warmed its own shapes
    assert len(shares[0]) + len(shares[1]) == len({(s.phase, s.batch, s.seq) for s in plan.shapes
                                                   if s.phase in phases})
    assert not [r for report in reports for r in report["results"] if r["status"] == "failed"], reports
    _launch({"mode": "real", "out": str(tmp_path / "real"), "device_ops": device_ops, "method": method,
             "data": str(data), "argv": argv, "output_dir": str(tmp_path / "run"),
             "script_lines": reports[0]["script_lines"]},
            {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
             "HF_DATASETS_CACHE": str(Path(os.environ["SHAPEPLAN_TESTS_CACHE"]) / "datasets-of-real-runs")})
    return reports, _ranks(tmp_path / "warm"), _ranks(tmp_path / "real")


def assert_covered(reports: list[dict[str, Any]], warm: list[dict[str, Any]], real: list[dict[str, Any]],
                   collectives: set[str]) -> None:
    """Every device-op signature some rank of the real run dispatched, some warm rank dispatched, `collectives`
    among them (the recorder sees them); an eager warm-up compiles nothing."""
    assert {r["status"] for report in reports for r in report["results"]} == {"eager"}
    warmed = warm[0]["signatures"] | warm[1]["signatures"]
    ran = real[0]["signatures"] | real[1]["signatures"]
    assert {s[0] for s in ran if s[0].startswith("c10d.")} >= collectives
    missing = ran - warmed
    assert missing == set(), sorted(map(str, missing))[:20]
