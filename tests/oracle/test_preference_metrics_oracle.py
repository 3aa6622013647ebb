"""DPO and KTO plans' data-dependent metric sizes equal the real trainers': per policy forward (train / eval) shape,
the set of completion-token counts (chosen and rejected halves, or desirable and undesirable rows) that the loss and
metrics select with a mask, and for KTO the set of desirable-row counts."""

from __future__ import annotations

from collections import defaultdict

import pytest

from shapeplan.services.analyze import analyze
from tests.conftest import TINY_MODEL
from tests.oracle.preference_harness import run_preference
from tests.oracle.test_preference_oracle import CONVERSATIONAL, EXPLICIT, UNPAIRED

pytestmark = pytest.mark.slow

# name -> (method, train data, TRL options, eval data)
CONFIGS = {
    "dpo-keep-start-eval": ("dpo", EXPLICIT, [
        "--per_device_train_batch_size", "3", "--max_length", "256", "--max_steps", "4", "--eval_strategy", "steps",
        "--eval_steps", "2", "--per_device_eval_batch_size", "4"], CONVERSATIONAL),
    "dpo-keep-end-ga": ("dpo", CONVERSATIONAL, [
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_length", "200",
        "--truncation_mode", "keep_end", "--max_steps", "3"], None),
    "kto-unpaired-eval": ("kto", UNPAIRED, [
        "--per_device_train_batch_size", "3", "--max_length", "200", "--max_steps", "5", "--eval_strategy", "steps",
        "--eval_steps", "3", "--per_device_eval_batch_size", "4"], UNPAIRED),
    "kto-paired": ("kto", CONVERSATIONAL, [
        "--per_device_train_batch_size", "4", "--max_steps", "4"], None),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_metric_sizes_equal_real_trainer(name: str) -> None:
    """The sizes are recorded by the guard's recorder (`loss_mask_sizes`), from the inputs of the trainer's own
    `_compute_loss`."""
    method, data, argv, eval_data = CONFIGS[name]
    plan = analyze(method, ["--dataset_name", str(data), "--model_name_or_path", str(TINY_MODEL), *argv],
                   eval_source=str(eval_data) if eval_data else None)
    run = run_preference(method, data, ["--pad_to_multiple_of", "128", *argv], eval_path=eval_data)
    tokens: dict[tuple[str, int, int], set[int]] = defaultdict(set)
    chosen_rows: dict[tuple[str, int, int], set[int]] = defaultdict(set)
    for forward in run.seen:
        if forward.phase in ("train", "eval"):
            tokens[(forward.phase, forward.batch, forward.seq)] |= set(forward.completion_tokens)
            if forward.chosen_rows is not None:
                chosen_rows[(forward.phase, forward.batch, forward.seq)].add(forward.chosen_rows)
    assert all(tokens.values())
    policy = [s for s in plan.shapes if s.phase in ("train", "eval")]
    assert {(s.phase, s.batch, s.seq): set(s.completion_tokens) for s in policy} == dict(tokens)
    assert {(s.phase, s.batch, s.seq): set(s.chosen_rows) for s in policy if s.chosen_rows} == dict(chosen_rows)
