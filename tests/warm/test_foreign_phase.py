"""`warm` runs every phase `analyze` plans for a method; a plan holding a phase its method never meets (edited by
hand, or made for another method) is refused in one line, exit 1, through the installed console script."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from shapeplan.plan.io import write_plan
from shapeplan.plan.model import Plan
from tests.conftest import CAPYBARA, ROOT, TLDR
from tests.warm import grpo_harness, harness


def _warm(plan: Plan, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    return subprocess.run([str(Path(sys.executable).parent / "shapeplan"), "warm", "--plan", str(path), "--device",
                           "cpu", "--cache-dir", str(tmp_path / "cache")],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)


def _with_phase(plan: Plan, phase: str) -> Plan:
    foreign = dataclasses.replace(plan.shapes[0], phase=phase, logits_to_keep=None)
    return dataclasses.replace(plan, shapes=(*plan.shapes, foreign))


def test_a_grpo_plan_with_a_kl_shape_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(TLDR.read_text(encoding="utf-8").splitlines()[:4]) + "\n", encoding="utf-8")
    plan = grpo_harness.plan_for("grpo", data, ["--per_device_train_batch_size", "2", "--num_generations", "2",
                                                "--max_completion_length", "4", "--max_steps", "1"], tmp_path / "out")
    done = _warm(_with_phase(plan, "kl"), tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "Error: the plan has kl shapes, which a grpo run does not meet; re-create the plan with `shapeplan analyze`"]


def test_an_sft_plan_with_a_ref_precompute_shape_is_refused(tmp_path: Path) -> None:
    plan = harness.plan_for("sft", CAPYBARA, ["--max_length", "256", "--max_steps", "1"], tmp_path / "out")
    done = _warm(_with_phase(plan, "ref_precompute"), tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "Error: the plan has ref_precompute shapes, which a sft run does not meet; re-create the plan with "
        "`shapeplan analyze`")
