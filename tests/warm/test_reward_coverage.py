"""Eager coverage for Reward: every ATen op signature a real `trl reward` run dispatches outside data loading is
dispatched by the warm-up of its plan (the sequence classifier's step, optimizer, eval loop)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.warm.harness import record
from tests.warm.trainer_harness import plan_for, real_run, warm_plan

pytestmark = pytest.mark.slow

EXPLICIT = ROOT / "tests" / "fixtures" / "preference-explicit.jsonl"
CONFIGS = {
    # max_length 384 drops the rows with a longer side
    "drop": ["--per_device_train_batch_size", "2", "--max_length", "384", "--max_steps", "3"],
    "eval-ga": ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "2",
                "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "16",
                "--dataset_test_split", "train"],
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_warm_dispatches_every_op_signature_of_the_real_run(name: str, tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    argv = CONFIGS[name]
    plan = plan_for("reward", EXPLICIT, argv, tmp_path / "out")
    real, _ = record(real_run, "reward", EXPLICIT, argv, tmp_path / "out")
    warmed, report = record(warm_plan, "reward", plan, tmp_path / "cache")
    assert not report.failed, report.failed
    missing = real - warmed
    assert missing == set(), sorted(map(str, missing))[:20]
