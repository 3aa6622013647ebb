"""Distillation plans equal what the real `DistillationTrainer` feeds the student and the teacher: generate sizes
with their static cache length, train / teacher / eval / eval_teacher forwards with `logits_to_keep`, counts and
first steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from shapeplan.services.analyze import analyze
from tests.conftest import TINY_MODEL
from tests.oracle.distillation_harness import run_distillation_trainer
from tests.oracle.grpo_harness import observed, planned
from tests.oracle.test_grpo_oracle import MIXED, STATIC, _rows
from tests.warm.harness import LORA

pytestmark = pytest.mark.slow

# name -> (train rows, eval rows (None: no eval), TRL options); rows are lines of TLDR.
CONFIGS = {
    # Rounds of B * GA = 4 prompts from every bucket from 128 to 512 tokens: the static cache grows.
    "accumulation-cache-growth": (MIXED, None, [
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_completion_length", "16",
        "--max_steps", "4", *STATIC]),
    # 10 prompts, rounds of 3: one tail prompt dropped each epoch; eval on start and every 2 steps, uneven last batch.
    "epochs-eval": (10, 5, [
        "--per_device_train_batch_size", "3", "--max_completion_length", "8", "--num_train_epochs", "2",
        "--eval_strategy", "steps", "--eval_steps", "2", "--eval_on_start", "true",
        "--per_device_eval_batch_size", "2", *STATIC]),
    # No padding multiple, one-token completions: every prompt length shows; a dynamic cache.
    "unpadded-dynamic-cache": (12, None, [
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "3", "--max_completion_length", "1",
        "--pad_to_multiple_of", "1", "--max_steps", "2"]),
}
# LoRA: the student's generate and backbone run inside the PeftModel
CONFIGS["epochs-eval-lora"] = (*CONFIGS["epochs-eval"][:2], [*CONFIGS["epochs-eval"][2], *LORA])


# Completions longer than one padding multiple: C depends on sampling, the prompt side stays exact.
SAMPLED = {
    "completion-256": (8, None, [
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_completion_length", "256",
        "--max_steps", "2", *STATIC]),
}


def _plan_and_run(configs: dict, name: str, tmp_path: Path):  # type: ignore[no-untyped-def,type-arg]
    train_rows, eval_rows, argv = configs[name]
    train = _rows(tmp_path / "train.jsonl", train_rows)
    eval_data = _rows(tmp_path / "eval.jsonl", eval_rows) if eval_rows else None
    plan = analyze("distillation", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_MODEL),
                                    "--teacher_model_name_or_path", str(TINY_MODEL), *argv],
                   eval_source=str(eval_data) if eval_data else None)
    seen = run_distillation_trainer(train, ["--pad_to_multiple_of", "128", *argv], eval_path=eval_data)
    return plan, seen


@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampled_completions_are_planned_possibilities(name: str, tmp_path: Path) -> None:
    plan, seen = _plan_and_run(SAMPLED, name, tmp_path)
    generate = {"generate", "eval_generate"}
    seen_map = observed(seen)
    possible = planned(plan)
    assert {k: v for k, v in possible.items() if k[0] in generate} == \
        {k: v for k, v in seen_map.items() if k[0] in generate}
    for key, (count, first_step) in seen_map.items():
        if key[0] not in generate:
            assert key in possible, key
            assert count <= possible[key][0] and first_step >= possible[key][1], key
    assert {s.logits_to_keep for s in plan.shapes if s.phase == "train"} == {128, 256}
    assert not any(s.certain for s in plan.shapes if s.phase in ("train", "teacher"))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_equals_real_trainer(name: str, tmp_path: Path) -> None:
    plan, seen = _plan_and_run(CONFIGS, name, tmp_path)
    assert all(s.certain for s in plan.shapes)
    assert planned(plan) == observed(seen)
    assert plan.stats.micro_batches == sum(1 for s in seen if s.phase == "train")
