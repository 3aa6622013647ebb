"""Streaming DPO, KTO and Reward (`--dataset_streaming`): the plan equals what the real trainer fed from an
IterableDataset gives its models (every phase: the reference forwards, KTO's KL rows rotated within each run of
train-batch-size rows of the stream, the eval loop), with one rank and with two (accelerate's IterableDatasetShard
on one file, the last chunk completed with the first rows; `IterableDataset.shard` on two files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shapeplan.errors import UsageError
from shapeplan.services.analyze import analyze
from tests.conftest import TINY_MODEL, write_files_by_length
from tests.oracle.harness import observed, planned, run_distributed
from tests.oracle.preference_harness import run_preference
from tests.oracle.test_preference_oracle import CONVERSATIONAL, EXPLICIT, UNPAIRED

pytestmark = pytest.mark.slow

# name -> (method, train data, TRL options, eval data)
CONFIGS = {
    # max_length 256 drops the rows whose prompt reaches it and cuts the rest; the eval stream (its last batch
    # partial) at every eval_steps multiple and the final step, with the reference forward
    "dpo-padded-eval": ("dpo", EXPLICIT, [
        "--per_device_train_batch_size", "4", "--max_length", "256", "--max_steps", "5", "--eval_strategy", "steps",
        "--eval_steps", "3", "--per_device_eval_batch_size", "3", "--pad_to_multiple_of", "64"], EXPLICIT),
    # 40 rows make 14 batches of 3 per pass (the last of one row), read again until max_steps 6 x GA 3; each pass's
    # last 14 % 3 micro-batches join the next pass's first step; eval at each pass's end
    "dpo-ga-short-stream": ("dpo", CONVERSATIONAL, [
        "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "3", "--max_steps", "6",
        "--eval_strategy", "epoch", "--per_device_eval_batch_size", "8", "--pad_to_multiple_of", "64"],
        CONVERSATIONAL),
    # KL rows rotated within runs of 4 stream rows, also in the eval stream read in batches of 3; GA 2
    "kto-unpaired-ga-eval": ("kto", UNPAIRED, [
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_length", "256",
        "--max_steps", "3", "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "3",
        "--pad_to_multiple_of", "64"], UNPAIRED),
    # paired rows unpaired into two (a batched map over the stream), cut at max_length 128
    "kto-paired-cut": ("kto", CONVERSATIONAL, [
        "--per_device_train_batch_size", "3", "--max_length", "128", "--max_steps", "5",
        "--pad_to_multiple_of", "32"], None),
    # max_length 384 drops the rows with a longer side; eval on another stream
    "reward-drop-eval": ("reward", CONVERSATIONAL, [
        "--per_device_train_batch_size", "4", "--max_length", "384", "--max_steps", "4", "--eval_strategy", "steps",
        "--eval_steps", "2", "--per_device_eval_batch_size", "3", "--pad_to_multiple_of", "64"], EXPLICIT),
    "reward-ga": ("reward", EXPLICIT, [
        "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2", "--max_steps", "4",
        "--pad_to_multiple_of", "128"], None),
}


def _plan(method: str, data: Path, argv: list[str], eval_data: Path | None):  # type: ignore[no-untyped-def]
    return analyze(method, ["--dataset_name", str(data), "--model_name_or_path", str(TINY_MODEL),
                            "--dataset_streaming", *argv], eval_source=str(eval_data) if eval_data else None)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stream_plan_equals_real_trainer(name: str) -> None:
    method, data, argv, eval_data = CONFIGS[name]
    plan = _plan(method, data, argv, eval_data)
    run = run_preference(method, data, argv, eval_path=eval_data, streaming=True)
    assert run.train_rows is None  # the real trainer read a stream
    assert plan.exact
    assert planned(plan, unpadded=True) == observed(run.seen, unpadded=True)
    train = [s for s in run.seen if s.phase == "train"]
    assert (plan.stats.micro_batches, plan.stats.optimizer_steps) == (len(train), run.optimizer_steps)


# method -> (train data, TRL options, eval data) for two ranks on one file
TWO_RANKS = {
    "dpo": (EXPLICIT, ["--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2", "--max_steps",
                       "3", "--max_length", "256", "--eval_strategy", "steps", "--eval_steps", "2",
                       "--per_device_eval_batch_size", "7", "--pad_to_multiple_of", "64"], EXPLICIT),
    "kto": (UNPAIRED, ["--per_device_train_batch_size", "3", "--max_steps", "4", "--max_length", "256",
                       "--eval_strategy", "steps", "--eval_steps", "3", "--per_device_eval_batch_size", "7",
                       "--pad_to_multiple_of", "64"], UNPAIRED),
    "reward": (CONVERSATIONAL, ["--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2",
                                "--max_steps", "3", "--max_length", "384", "--eval_strategy", "steps",
                                "--eval_steps", "2", "--per_device_eval_batch_size", "7",
                                "--pad_to_multiple_of", "64"], CONVERSATIONAL),
}


@pytest.mark.parametrize("method", sorted(TWO_RANKS))
def test_two_process_stream_plan_equals_real_trainer(method: str, tmp_path: Path) -> None:
    """2 ranks on a one-file stream: IterableDatasetShard hands out chunks of batch x 2 prepared rows; the eval
    stream's last chunk is completed with its first rows."""
    data, argv, eval_data = TWO_RANKS[method]
    plan = _plan(method, data, [*argv, "--num-processes", "2"], eval_data)
    seen = run_distributed(data, argv, method=method, eval_path=eval_data, num_processes=2, tmp_dir=tmp_path,
                           streaming=True)
    assert {s.rank for s in seen} == {0, 1}
    assert planned(plan, unpadded=True) == observed(seen, unpadded=True)


def test_short_dpo_stream_of_several_files_equals_real_trainer(tmp_path: Path) -> None:
    """A DPO stream of 4 files, shorter than max_steps needs: before each new pass the Trainer's `set_epoch` makes
    datasets deal the files in a new order, so each pass batches the rows in its own order (the files hold rows of
    different lengths)."""
    folder = write_files_by_length(EXPLICIT, tmp_path / "data", 4)
    argv = ["--per_device_train_batch_size", "3", "--max_steps", "30", "--max_length", "1024",
            "--pad_to_multiple_of", "32"]
    plan = _plan("dpo", folder, argv, None)
    assert any("the whole stream 3 times, each pass in its own order" in w for w in plan.warnings), plan.warnings
    run = run_preference("dpo", folder, argv, streaming=True)
    assert planned(plan, unpadded=True) == observed(run.seen, unpadded=True)


def test_two_process_kto_stream_sharded_by_files_equals_real_trainer(tmp_path: Path) -> None:
    """A KTO stream of 2 files on 2 ranks: each rank reads its own file, and TRL's KL rotation groups the rows of
    that file (the preparation runs on each rank's shard). The long rows are in one file and the short ones in the
    other."""
    folder = tmp_path / "data"
    folder.mkdir()
    lines = sorted(UNPAIRED.read_text().splitlines(keepends=True), key=len)
    (folder / "a.jsonl").write_text("".join(lines[20:]))
    (folder / "b.jsonl").write_text("".join(lines[:20]))
    argv = ["--per_device_train_batch_size", "3", "--max_steps", "4", "--max_length", "1024",
            "--pad_to_multiple_of", "32"]
    plan = _plan("kto", folder, [*argv, "--num-processes", "2"], None)
    seen = run_distributed(folder, argv, method="kto", num_processes=2, tmp_dir=tmp_path, streaming=True)
    assert planned(plan, unpadded=True) == observed(seen, unpadded=True)


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_precompute_on_a_stream_is_refused_as_trl_refuses_it(method: str) -> None:
    """TRL's `_precompute_ref_logps` raises on an IterableDataset; the plan is refused in one line naming why."""
    data = UNPAIRED if method == "kto" else EXPLICIT
    argv = ["--per_device_train_batch_size", "2", "--max_steps", "1", "--precompute_ref_log_probs", "true"]
    with pytest.raises(UsageError, match="refuses precompute_ref_log_probs=True on a streamed dataset"):
        _plan(method, data, argv, None)
    with pytest.raises(ValueError, match="not supported with IterableDataset"):
        run_preference(method, data, argv, streaming=True)
