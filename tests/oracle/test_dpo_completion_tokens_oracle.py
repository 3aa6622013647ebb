"""DPO plans' completion-token counts equal the real `DPOTrainer`'s: per policy forward (train / eval) shape, the
set of chosen and rejected completion-token counts its metrics select with the completion mask."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from shapeplan.analyze import analyze
from tests.conftest import TINY_MODEL
from tests.oracle.preference_harness import run_preference
from tests.oracle.test_preference_oracle import CONVERSATIONAL, EXPLICIT

pytestmark = pytest.mark.slow

# name -> (train data, TRL options, eval data)
CONFIGS = {
    "keep-start-eval": (EXPLICIT, [
        "--per_device_train_batch_size", "3", "--max_length", "256", "--max_steps", "4", "--eval_strategy", "steps",
        "--eval_steps", "2", "--per_device_eval_batch_size", "4"], CONVERSATIONAL),
    "keep-end-ga": (CONVERSATIONAL, [
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_length", "200",
        "--truncation_mode", "keep_end", "--max_steps", "3"], None),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_completion_tokens_equal_real_trainer(name: str) -> None:
    from trl import DPOTrainer

    data, argv, eval_data = CONFIGS[name]
    plan = analyze("dpo", ["--dataset_name", str(data), "--model_name_or_path", str(TINY_MODEL), *argv],
                   eval_source=str(eval_data) if eval_data else None)
    seen: dict[tuple[str, int, int], set[int]] = defaultdict(set)
    compute_loss = DPOTrainer._compute_loss

    def recording(self: Any, model: Any, inputs: dict[str, Any], return_outputs: bool) -> Any:
        mask = inputs["completion_mask"][..., 1:]
        chosen, rejected = mask.chunk(2, dim=0)
        phase = "train" if self.model.training else "eval"
        seen[(phase, *inputs["input_ids"].shape)] |= {int(chosen.sum()), int(rejected.sum())}
        return compute_loss(self, model, inputs, return_outputs)

    DPOTrainer._compute_loss = recording
    try:
        run_preference("dpo", data, ["--pad_to_multiple_of", "128", *argv], eval_path=eval_data)
    finally:
        DPOTrainer._compute_loss = compute_loss
    planned = {(s.phase, s.batch, s.seq): set(s.completion_tokens) for s in plan.shapes if s.phase in ("train", "eval")}
    assert planned == dict(seen)

