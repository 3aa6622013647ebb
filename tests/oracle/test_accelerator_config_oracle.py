"""accelerate's dataloader options (`--accelerator_config`: split_batches, even_batches, dispatch_batches) on two
data-parallel ranks: the plan equals what the real trainers feed the model on each rank (gloo on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shapeplan.errors import UsageError
from shapeplan.services.analyze import analyze
from tests.conftest import CAPYBARA, TINY_MODEL
from tests.oracle import grpo_harness
from tests.oracle.harness import observed, planned, run_distributed
from tests.oracle.test_grpo_oracle import MIXED, _rows
from tests.oracle.test_preference_oracle import EXPLICIT, UNPAIRED
from tests.oracle.test_sft_oracle import TEXT

pytestmark = pytest.mark.slow


def _accelerator(**options: bool) -> list[str]:
    return ["--accelerator_config", json.dumps(options)]


def _plan(method: str, data: Path, argv: list[str], eval_data: Path | None, *, streaming: bool = False):  # type: ignore[no-untyped-def]
    return analyze(method, ["--dataset_name", str(data), "--model_name_or_path", str(TINY_MODEL),
                            *(["--dataset_streaming"] if streaming else []), *argv, "--num-processes", "2"],
                   eval_source=str(eval_data) if eval_data else None, use_cache=False)


# name -> (method, train data, TRL options, eval data, streamed)
CASES: dict[str, tuple[str, Path, list[str], Path | None, bool]] = {
    # each rank trains on half of every batch of 4 (2 rows); eval batches of 6 split in 3s, the last completed
    "sft-split": ("sft", CAPYBARA, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                                    "--max_steps", "5", "--max_length", "256", "--pad_to_multiple_of", "32",
                                    "--eval_strategy", "steps", "--eval_steps", "3", "--per_device_eval_batch_size",
                                    "6", *_accelerator(split_batches=True)], CAPYBARA, False),
    # 30 rows in batches of 4: 8 batches, 4 per rank; rank 1's last holds 2 rows (not 4 wrapped around), in train
    # (two epochs) and in eval
    "sft-uneven": ("sft", TEXT, ["--per_device_train_batch_size", "4", "--num_train_epochs", "2", "--max_length",
                                 "128", "--pad_to_multiple_of", "16", "--eval_strategy", "epoch",
                                 "--per_device_eval_batch_size", "4", *_accelerator(even_batches=False)], TEXT, False),
    # rank 0 collates each whole batch of 4 (padded to its longest row) and sends each rank 2 of its rows
    "sft-dispatch-split": ("sft", CAPYBARA, ["--per_device_train_batch_size", "4", "--max_steps", "6", "--max_length",
                                             "512", "--pad_to_multiple_of", "32", "--eval_strategy", "steps",
                                             "--eval_steps", "6", "--per_device_eval_batch_size", "6",
                                             *_accelerator(split_batches=True, dispatch_batches=True)],
                           CAPYBARA, False),
    # rank 0 concatenates 2 batches (all padded to 64) and slices them; 30 rows of 4: the last group of 2 batches
    # holds 6 rows, 3 per rank; eval's 30 rows in 7s: the last group holds 2 rows, 1 per rank
    "sft-dispatch": ("sft", TEXT, ["--per_device_train_batch_size", "4", "--num_train_epochs", "1", "--max_length",
                                   "64", "--pad_to_multiple_of", "64", "--eval_strategy", "epoch",
                                   "--per_device_eval_batch_size", "7", *_accelerator(dispatch_batches=True)],
                     TEXT, False),
    # batch_rebalance's sampler shards itself, but under dispatch only rank 0's dataloader is read: rank 0
    # concatenates pairs of its own rebalanced batches (all padded to 64) and sends each rank one
    "sft-dispatch-rebalance": ("sft", TEXT, ["--per_device_train_batch_size", "4", "--num_train_epochs", "1",
                                             "--max_length", "64", "--pad_to_multiple_of", "64",
                                             "--train_sampling_strategy", "batch_rebalance",
                                             *_accelerator(dispatch_batches=True)], None, False),
    "dpo-split": ("dpo", EXPLICIT, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                                    "--max_steps", "3", "--max_length", "256", "--eval_strategy", "steps",
                                    "--eval_steps", "2", "--per_device_eval_batch_size", "6", "--pad_to_multiple_of",
                                    "64", *_accelerator(split_batches=True)], EXPLICIT, False),
    # 40 pairs in batches of 4: rank 0 concatenates 2 collated batches (chosen then rejected, all padded to 512) and
    # cuts them into 2 slices of 8 rows, each one whole batch: the ranks train as without dispatch; eval alike
    "dpo-dispatch": ("dpo", EXPLICIT, ["--per_device_train_batch_size", "4", "--max_steps", "3", "--max_length",
                                       "512", "--pad_to_multiple_of", "512", "--eval_strategy", "steps",
                                       "--eval_steps", "3", "--per_device_eval_batch_size", "4",
                                       *_accelerator(dispatch_batches=True)], EXPLICIT, False),
    # KTO collates one row per example (and one KL row): rank 0 pads each whole batch of 4 and sends 2 rows per rank
    "kto-dispatch-split": ("kto", UNPAIRED, ["--per_device_train_batch_size", "4", "--max_steps", "3",
                                             "--max_length", "256", "--pad_to_multiple_of", "32", "--eval_strategy",
                                             "steps", "--eval_steps", "3", "--per_device_eval_batch_size", "6",
                                             *_accelerator(split_batches=True, dispatch_batches=True)],
                           UNPAIRED, False),
    # a one-file stream: IterableDatasetShard cuts each chunk of 4 rows in two
    "sft-stream-split": ("sft", CAPYBARA, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                                           "--max_steps", "4", "--max_length", "128", "--pad_to_multiple_of", "32",
                                           "--eval_strategy", "steps", "--eval_steps", "3",
                                           "--per_device_eval_batch_size", "6", *_accelerator(split_batches=True)],
                         CAPYBARA, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_process_plan_equals_real_trainer(name: str, tmp_path: Path) -> None:
    method, data, argv, eval_data, streaming = CASES[name]
    plan = _plan(method, data, argv, eval_data, streaming=streaming)
    seen = run_distributed(data, argv, method=method, eval_path=eval_data, num_processes=2, tmp_dir=tmp_path,
                           streaming=streaming)
    assert {s.rank for s in seen} == {0, 1}
    assert plan.exact
    assert planned(plan, unpadded=True) == observed(seen, unpadded=True)
    if "batch_rebalance" in argv:  # one epoch reads rank 0's share only (fewer rows than the set), as the plan says
        assert sum(s.batch for s in seen if s.phase == "train") < plan.stats.rows
        assert any("trains on 1/2 of the data" in w for w in plan.warnings)


def test_two_process_grpo_split_plan_equals_real_trainer(tmp_path: Path) -> None:
    """GRPO with split_batches: each rank gets half of every generation batch (per_device_train_batch_size x
    steps_per_generation prompts' completions), and trains on half-size micro-batches."""
    train = _rows(tmp_path / "train.jsonl", MIXED)
    eval_data = _rows(tmp_path / "eval.jsonl", slice(0, 5))
    argv = ["--per_device_train_batch_size", "4", "--num_generations", "2", "--gradient_accumulation_steps", "2",
            "--max_completion_length", "8", "--max_steps", "3", "--eval_strategy", "steps", "--eval_steps", "2",
            "--per_device_eval_batch_size", "4", "--cache_implementation", "static", "--pad_to_multiple_of", "128",
            *_accelerator(split_batches=True)]
    plan = _plan("grpo", train, argv, eval_data)
    seen = grpo_harness.run_generation_trainer_distributed("grpo", train, argv, eval_path=eval_data, tmp_dir=tmp_path)
    assert {s.rank for s in seen} == {0, 1}
    assert grpo_harness.planned(plan) == grpo_harness.observed(seen)


def test_dispatch_of_batches_padded_apart_is_refused_as_accelerate_fails(tmp_path: Path) -> None:
    """dispatch_batches without split_batches: rank 0 concatenates two batches padded on their own, which torch.cat
    fails on when their lengths differ; the plan refuses it in one line and the real run fails."""
    argv = ["--per_device_train_batch_size", "2", "--max_steps", "2", "--max_length", "512",
            *_accelerator(dispatch_batches=True)]
    with pytest.raises(UsageError, match=r"^dispatch_batches=true: rank 0 concatenates batches padded to \d+ and "):
        _plan("sft", CAPYBARA, argv, None)
    with pytest.raises(RuntimeError, match="You can't use batches of different size with `dispatch_batches=True`"):
        run_distributed(CAPYBARA, argv, num_processes=2, tmp_dir=tmp_path)


def test_two_process_dispatch_completes_an_odd_last_batch(tmp_path: Path) -> None:
    """dispatch_batches with split_batches on 29 rows in batches of 4: the last batch holds 1 row, which rank 0
    completes with the first 2 rows of the first batch (padded as that batch was), 1 row per rank; every batch pads
    to 64, so the concatenation holds."""
    data = tmp_path / "odd.jsonl"
    data.write_text("".join(TEXT.read_text().splitlines(keepends=True)[:29]))
    argv = ["--per_device_train_batch_size", "4", "--num_train_epochs", "1", "--max_length", "64",
            "--pad_to_multiple_of", "64", "--eval_strategy", "epoch", "--per_device_eval_batch_size", "6",
            *_accelerator(split_batches=True, dispatch_batches=True)]
    plan = _plan("sft", data, argv, data)
    assert {(s.phase, s.batch) for s in plan.shapes} == {("train", 2), ("train", 1), ("eval", 3)}
    seen = run_distributed(data, argv, eval_path=data, num_processes=2, tmp_dir=tmp_path)
    assert planned(plan, unpadded=True) == observed(seen, unpadded=True)


def test_generation_trainer_dispatch_is_refused_as_accelerate_fails(tmp_path: Path) -> None:
    """GRPO's collator hands over the list of example dicts itself; with dispatch_batches rank 0 concatenates them
    (or broadcasts them, with split_batches), which accelerate fails on (strings are no tensors): the plan refuses it
    in one line and the real run fails."""
    train = _rows(tmp_path / "train.jsonl", MIXED)
    argv = ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8",
            "--max_steps", "2", *_accelerator(dispatch_batches=True)]
    with pytest.raises(UsageError, match=r"^dispatch_batches=true on several ranks: rank 0 would concatenate or "):
        _plan("grpo", train, argv, None)
    with pytest.raises(RuntimeError, match="TypeError: Can only concatenate tensors but got"):
        grpo_harness.run_generation_trainer_distributed("grpo", train, argv, tmp_dir=tmp_path)
