"""Streaming GRPO, RLOO and Distillation (`--dataset_streaming`): the plan equals what the real trainer fed from an
IterableDataset (`load_dataset(..., streaming=True)`, as `trl <method>`'s main() loads it) gives the models: TRL's
buffered shuffle of the stream (reshuffled each pass), its `repeat_iterable_dataset`, the shuffled eval stream, and
accelerate's sharding across two ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from shapeplan.services.analyze import analyze
from tests.conftest import TINY_MODEL, write_short_text_rows
from tests.oracle.distillation_harness import run_distillation_trainer
from tests.oracle.grpo_harness import (
    observed,
    planned,
    run_generation_trainer,
    run_generation_trainer_distributed,
)
from tests.oracle.test_grpo_oracle import MIXED, _rows

pytestmark = pytest.mark.slow

SHUFFLE_BUFFER = 1000  # datasets' IterableDataset.shuffle default, which TRL keeps
# TRL's "auto" resolves to no padding on CPU: the real runs pad as on Neuron, to 128 unless a config says otherwise
STATIC = ["--cache_implementation", "static", "--pad_to_multiple_of", "128"]


# name -> (method, train rows: a count of generated short prompts, or TLDR lines; eval TLDR lines or None; options)
CONFIGS = {
    # 2400 rows, more than the shuffle buffer holds: the buffered shuffle's order, not a permutation of the first
    # rows; the prompt buckets (multiples of 16) and the growing static cache follow it.
    "grpo-shuffle-beyond-buffer": ("grpo", 2400, None, [
        "--per_device_train_batch_size", "4", "--num_generations", "2", "--gradient_accumulation_steps", "2",
        "--max_completion_length", "8", "--max_steps", "6", "--seed", "3", "--cache_implementation", "static",
        "--pad_to_multiple_of", "16"]),
    # 11 rows of every bucket from 128 to 512 tokens, shorter than max_steps needs: the Trainer reads the stream
    # again, reshuffled each pass (set_epoch), the trailing partial generation batch dropped; eval (a shuffled
    # stream) at each pass end
    "grpo-short-stream-reshuffled-eval": ("grpo", MIXED.start + 11, slice(0, 5), [
        "--per_device_train_batch_size", "2", "--num_generations", "2", "--gradient_accumulation_steps", "2",
        "--max_completion_length", "8", "--max_steps", "9", "--eval_strategy", "epoch",
        "--per_device_eval_batch_size", "4", "--num_generations_eval", "2", *STATIC]),
    "rloo-eval": ("rloo", MIXED, slice(0, 5), [
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_completion_length", "16",
        "--max_steps", "3", "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "2",
        *STATIC]),
    # rounds of B x GA prompts, each repeated GA times; an eval stream every 2 steps
    "distillation-eval": ("distillation", MIXED, slice(0, 5), [
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_completion_length", "16",
        "--max_steps", "4", "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "2",
        *STATIC]),
}


def _data(rows: int | slice, path: Path) -> Path:
    if isinstance(rows, int) and rows > SHUFFLE_BUFFER:
        return write_short_text_rows(path, rows, column="prompt", max_words=60)
    return _rows(path, rows if isinstance(rows, slice) else slice(MIXED.start, rows))


def _plan(method: str, train: Path, argv: list[str], eval_data: Path | None):  # type: ignore[no-untyped-def]
    teacher = ["--teacher_model_name_or_path", str(TINY_MODEL)] if method == "distillation" else []
    return analyze(method, ["--dataset_name", str(train), "--model_name_or_path", str(TINY_MODEL),
                            "--dataset_streaming", *teacher, *argv],
                   eval_source=str(eval_data) if eval_data else None, use_cache=False)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stream_plan_equals_real_trainer(name: str, tmp_path: Path) -> None:
    method, train_rows, eval_rows, argv = CONFIGS[name]
    train = _data(train_rows, tmp_path / "train.jsonl")
    eval_data = _rows(tmp_path / "eval.jsonl", eval_rows) if eval_rows else None
    plan = _plan(method, train, argv, eval_data)
    if method == "distillation":
        seen = run_distillation_trainer(train, argv, eval_path=eval_data, streaming=True)
    else:
        seen = run_generation_trainer(method, train, argv, eval_path=eval_data, streaming=True)
    assert plan.exact and all(s.certain for s in plan.shapes)
    assert planned(plan) == observed(seen)
    assert plan.stats.micro_batches == sum(1 for s in seen if s.phase == "train")


def test_two_process_stream_plan_equals_real_trainer(tmp_path: Path) -> None:
    """2 ranks on a one-file shuffled stream: IterableDatasetShard deals each rank its half of every generation
    batch; the eval stream's last chunk is completed with its first rows."""
    train = _rows(tmp_path / "train.jsonl", MIXED)
    eval_data = _rows(tmp_path / "eval.jsonl", slice(0, 5))
    argv = ["--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "8",
            "--max_steps", "3", "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "2",
            *STATIC]
    plan = _plan("grpo", train, [*argv, "--num-processes", "2"], eval_data)
    seen = run_generation_trainer_distributed("grpo", train, argv, eval_path=eval_data, streaming=True,
                                              tmp_dir=tmp_path)
    assert {s.rank for s in seen} == {0, 1}
    assert planned(plan) == observed(seen)
