"""Eager coverage for KTO: every ATen op signature a real `trl kto` run dispatches outside data loading is
dispatched by the warm-up of its plan (KL and main forwards of policy and reference, loss over the desirable and
undesirable rows, backward, optimizer, eval loop)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.warm.harness import record
from tests.warm.trainer_harness import plan_for, real_run, warm_plan

pytestmark = pytest.mark.slow

UNPAIRED = ROOT / "tests" / "fixtures" / "kto-unpaired.jsonl"
CONFIGS = {
    "truncate": ["--per_device_train_batch_size", "3", "--max_length", "256", "--max_steps", "3"],
    "eval-ga": ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "2",
                "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "16",
                "--dataset_test_split", "train"],
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_warm_dispatches_every_op_signature_of_the_real_run(name: str, tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    argv = CONFIGS[name]
    plan = plan_for("kto", UNPAIRED, argv, tmp_path / "out")
    real, _ = record(real_run, "kto", UNPAIRED, argv, tmp_path / "out")
    warmed, report = record(warm_plan, "kto", plan, tmp_path / "cache")
    assert not report.failed, report.failed
    missing = real - warmed
    assert missing == set(), sorted(map(str, missing))[:20]
