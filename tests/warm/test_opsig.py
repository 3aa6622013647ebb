"""Eager coverage: every ATen op signature a real SFT run dispatches (what TorchNeuron's eager NEFF cache is keyed
on) is dispatched by the warm-up of its plan, and the warm-up dispatches nothing the run does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import CAPYBARA
from tests.warm.harness import LORA, plan_for, real_run, record, warm_plan

pytestmark = pytest.mark.slow

CONFIGS = {
    "padded": ["--max_length", "256", "--per_device_train_batch_size", "2", "--max_steps", "3", "--logging_steps", "2"],
    "packing": ["--max_length", "256", "--per_device_train_batch_size", "2", "--max_steps", "3", "--packing"],
    "eval-ga": ["--max_length", "256", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                "--max_steps", "3", "--eval_strategy", "steps", "--eval_steps", "2",
                "--per_device_eval_batch_size", "16", "--dataset_test_split", "train"],
    # padding-free eval with a short last batch (the loop cuts the gathered losses to the remainder)
    "packing-eval": ["--max_length", "256", "--per_device_train_batch_size", "2", "--max_steps", "2", "--packing",
                     "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "8",
                     "--dataset_test_split", "train"],
    # a streamed run (IterableDataset, no sampler): padded with a streamed eval set whose last batch is short (a
    # stream has no length, so the eval loop cuts nothing), and packed
    "stream-padded-eval": ["--dataset_streaming", "--max_length", "256", "--per_device_train_batch_size", "2",
                           "--max_steps", "3", "--eval_strategy", "steps", "--eval_steps", "2",
                           "--per_device_eval_batch_size", "10", "--dataset_test_split", "train"],
    # LoRA on every linear layer: adapter matmuls, frozen base weights
    "padded-lora": ["--max_length", "256", "--per_device_train_batch_size", "2", "--max_steps", "3", *LORA],
    "stream-packing": ["--dataset_streaming", "--max_length", "256", "--per_device_train_batch_size", "2",
                       "--max_steps", "3", "--packing"],
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_warm_dispatches_every_op_signature_of_the_real_run(name: str, tmp_path: Path) -> None:
    argv = CONFIGS[name]
    plan = plan_for("sft", CAPYBARA, argv, tmp_path / "out")
    real, _ = record(real_run, "sft", CAPYBARA, argv, tmp_path / "out")
    warmed, report = record(warm_plan, plan, tmp_path / "cache")
    assert [r.status for r in report.results] == ["eager"] * len(plan.shapes)  # eager on CPU: nothing compiles
    missing = real - warmed
    assert missing == set(), sorted(map(str, missing))[:20]
    # The plan says which layouts its batches come in (padded or not, padding-free pairs): the warm-up compiles
    # nothing outside it.
    extra = warmed - real
    assert extra == set(), sorted(map(str, extra))[:20]
