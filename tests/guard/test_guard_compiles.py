"""Compiles under torch.compile (Inductor): a guarded real run on a cold cache reports the compiles of each shape at
the step that first met it, and only then. (That a warmed cache leaves a guarded run nothing to compile is held in
test_peft_compiles.py and tests/warm/test_data_parallel.py, and for the plain trl command in
tests/warm/test_inductor_cache.py; a GRPO record warmed with `warm --plan RUN`, in test_guard_cli.py.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from shapeplan.plan.io import load_plan
from tests import console
from tests.conftest import ROOT
from tests.guard.test_guard_cli import TRL_RUN, _sft_config

pytestmark = pytest.mark.slow


def _run(*args: str | Path, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    return console.run(args, env=env)


def test_compiles_are_attributed_to_the_step_that_first_meets_the_shape(tmp_path: Path) -> None:
    config = _sft_config(tmp_path)
    with config.open("a", encoding="utf-8") as f:
        f.write("torch_compile: true\n")
    plan_path, cache = tmp_path / "plan.json", tmp_path / "cache"
    assert _run("analyze", "--config", config, "-o", plan_path, cache=cache).returncode == 0
    plan = load_plan(plan_path)
    train = sorted((s for s in plan.shapes if s.phase == "train"), key=lambda s: s.first_step)
    assert len(train) == 2 and train[1].first_step > 1

    record = tmp_path / "cold.json"
    result = _run("guard", "--plan", plan_path, "--record", record, "--", "trl", "sft", "--config", config,
                  "--output_dir", tmp_path / "out", *TRL_RUN, cache=cache)
    assert result.returncode == 0, result.stderr[-3000:]
    cold = json.loads(record.read_text())
    # each train shape compiles at the step that first meets it, and only then
    assert [(e["step"], [(s["phase"], s["batch"], s["seq"]) for s in e["shapes"]]) for e in cold["compiles"]] == [
        (s.first_step, [("train", s.batch, s.seq)]) for s in train]
    assert all(e["counters"].get("fxgraph_cache_miss", 0) > 0 for e in cold["compiles"])
