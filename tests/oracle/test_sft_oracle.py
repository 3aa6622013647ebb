"""The SFT plan equals what the real SFTTrainer feeds the model: shapes, counts and first steps."""

from __future__ import annotations

import pytest

from shapeplan.analyze import analyze
from tests.conftest import CAPYBARA, TINY_MODEL, TLDR
from tests.oracle.harness import observed, planned, run_sft

pytestmark = pytest.mark.slow

CONFIGS = {
    "padded-eval": (CAPYBARA, ["--per_device_train_batch_size", "4", "--max_steps", "10", "--eval_strategy", "steps",
                               "--eval_steps", "4", "--per_device_eval_batch_size", "3"], CAPYBARA),
    "prompt-completion-ga": (TLDR, ["--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2",
                                    "--num_train_epochs", "2", "--max_length", "256"], None),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_equals_real_trainer(name: str) -> None:
    data, argv, eval_data = CONFIGS[name]
    plan = analyze("sft", ["--dataset_name", str(data), "--model_name_or_path", str(TINY_MODEL), *argv],
                   eval_source=str(eval_data) if eval_data else None)
    seen = run_sft(data, ["--pad_to_multiple_of", "128", *argv], eval_path=eval_data)
    assert planned(plan) == observed(seen)
