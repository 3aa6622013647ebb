"""Streaming SFT (`--dataset_streaming`): the plan equals what a real SFTTrainer fed from an IterableDataset gives the
model: shapes, counts and first steps (and for padding-free batches the cu_seq_lens lengths and max_length_q values),
with one rank and with two (accelerate's IterableDatasetShard, the last chunk completed with the first rows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shapeplan.services.analyze import analyze
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL, TLDR, write_files_by_length, write_short_text_rows
from tests.oracle.harness import observed, planned, run_distributed, run_sft

pytestmark = pytest.mark.slow

TEXT = ROOT / "tests" / "fixtures" / "text.jsonl"


# name -> (train data or None for the generated short rows, TRL options, eval data)
CONFIGS: dict[str, tuple[Path | None, list[str], Path | None]] = {
    # padded batches, GA, a streamed eval set at every eval_steps multiple and the final step (partial last batch)
    "padded-eval": (CAPYBARA, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                               "--max_steps", "5", "--max_length", "256", "--pad_to_multiple_of", "64",
                               "--eval_strategy", "steps", "--eval_steps", "3", "--per_device_eval_batch_size", "7"],
                    CAPYBARA),
    # bfd packing over 2 of TRL's 1000-row pack batches (each packed on its own), collated padding-free
    "packing-bfd-across-pack-batches": (None, ["--packing", "--max_length", "128", "--per_device_train_batch_size",
                                               "4", "--max_steps", "30", "--pad_to_multiple_of", "64"], None),
    # padding-free without packing (max_length none): (1, sum of the batch's rows), with the cu_seq_lens they give
    "padding-free-unpacked": (TLDR, ["--padding_free", "--max_length", "none", "--per_device_train_batch_size", "4",
                                     "--gradient_accumulation_steps", "2", "--max_steps", "3",
                                     "--pad_to_multiple_of", "64"], None),
    # wrapped packing, padded collator
    "packing-wrapped": (TEXT, ["--packing", "--packing_strategy", "wrapped", "--max_length", "64",
                               "--per_device_train_batch_size", "3", "--max_steps", "4", "--pad_to_multiple_of", "32"],
                        None),
    # a stream shorter than max_steps needs: 96 rows make 10 batches of 10 per pass (the last short), read again
    # until max_steps; each pass's last 10 % 3 micro-batches join the next pass's first step; eval at each pass end
    "short-stream-passes": (CAPYBARA, ["--per_device_train_batch_size", "10", "--gradient_accumulation_steps", "3",
                                       "--max_steps", "8", "--max_length", "256", "--pad_to_multiple_of", "64",
                                       "--eval_strategy", "epoch", "--per_device_eval_batch_size", "32"],
                            CAPYBARA),
    # a short stream with shuffle_dataset: the Trainer's set_epoch reshuffles each pass (the buffer holds all 96
    # rows), so every pass batches the rows anew; 19 batches of 5 per pass (the last short), GA 2 (a leftover
    # micro-batch per pass), eval at each pass end
    "short-stream-reshuffled": (CAPYBARA, ["--shuffle_dataset", "--seed", "3", "--per_device_train_batch_size", "5",
                                           "--gradient_accumulation_steps", "2", "--max_steps", "24", "--max_length",
                                           "512", "--pad_to_multiple_of", "32", "--eval_strategy", "epoch",
                                           "--per_device_eval_batch_size", "32"], CAPYBARA),
    # the same with bfd packing, shuffled before and after packing: each pass packs its own order, so its packed
    # rows (and how many there are) differ from pass to pass
    "short-stream-reshuffled-packing": (TEXT, ["--shuffle_dataset", "--seed", "1", "--packing", "--max_length", "64",
                                               "--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
                                               "2", "--max_steps", "30", "--pad_to_multiple_of", "32"], None),
    # shuffle_dataset is a buffered shuffle of the stream (TRL's own preparation path)
    "shuffled-truncated": (CAPYBARA, ["--shuffle_dataset", "--seed", "5", "--max_length", "128",
                                      "--per_device_train_batch_size", "3", "--max_steps", "6",
                                      "--pad_to_multiple_of", "32"], None),
}


def _data(data: Path | None, tmp_path: Path) -> Path:
    return data if data is not None else write_short_text_rows(tmp_path / "short.jsonl", 2400)


def _plan(data: Path, argv: list[str], eval_data: Path | None):  # type: ignore[no-untyped-def]
    return analyze("sft", ["--dataset_name", str(data), "--model_name_or_path", str(TINY_MODEL),
                           "--dataset_streaming", *argv], eval_source=str(eval_data) if eval_data else None)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stream_plan_equals_real_trainer(name: str, tmp_path: Path) -> None:
    data, argv, eval_data = CONFIGS[name]
    data = _data(data, tmp_path)
    plan = _plan(data, argv, eval_data)
    seen = run_sft(data, argv, eval_path=eval_data, streaming=True)
    assert plan.exact
    assert planned(plan, varlen=True, unpadded=True) == observed(seen, varlen=True, unpadded=True)
    train = [s for s in seen if s.phase == "train"]
    assert (plan.stats.micro_batches, plan.stats.optimizer_steps) == (len(train), max(s.step for s in train))


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packing"])
def test_two_process_stream_plan_equals_real_trainer(packing: bool, tmp_path: Path) -> None:
    """2 ranks on a one-file stream: IterableDatasetShard hands out chunks of batch x 2 rows; the eval stream's last
    chunk is completed with its first rows."""
    argv = ["--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2", "--max_steps", "4",
            "--max_length", "128", "--pad_to_multiple_of", "32", "--eval_strategy", "steps", "--eval_steps", "3",
            "--per_device_eval_batch_size", "5", *(["--packing"] if packing else [])]
    plan = _plan(CAPYBARA, [*argv, "--num-processes", "2"], CAPYBARA)
    seen = run_distributed(CAPYBARA, argv, eval_path=CAPYBARA, num_processes=2, tmp_dir=tmp_path,
                               streaming=True)
    assert {s.rank for s in seen} == {0, 1}
    assert planned(plan, varlen=True) == observed(seen, varlen=True)


def test_short_stream_of_several_files_equals_real_trainer(tmp_path: Path) -> None:
    """A stream of 4 files, shorter than max_steps needs, no shuffle: before each new pass the Trainer's `set_epoch`
    makes datasets deal the files in a new order, so each pass batches the rows in its own order. The files hold
    rows of different lengths, so that order decides the batches' shapes."""
    folder = write_files_by_length(CAPYBARA, tmp_path / "data", 4)
    argv = ["--per_device_train_batch_size", "5", "--max_steps", "60", "--max_length", "1024",
            "--pad_to_multiple_of", "32"]
    plan = _plan(folder, argv, None)
    assert any("the whole stream 3 times, each pass in its own order" in w for w in plan.warnings), plan.warnings
    assert planned(plan) == observed(run_sft(folder, argv, streaming=True))


def test_two_process_stream_sharded_by_files_equals_real_trainer(tmp_path: Path) -> None:
    """A stream of 2 files on 2 ranks: accelerate gives each rank its own file (`IterableDataset.shard`), so each
    rank reads its own stream in order. The long rows are in one file and the short ones in the other, so rank 1
    meets other shapes than it would reading every other batch of the one stream."""
    folder = tmp_path / "data"
    folder.mkdir()
    lines = sorted(CAPYBARA.read_text().splitlines(keepends=True), key=len)
    (folder / "a.jsonl").write_text("".join(lines[48:]))
    (folder / "b.jsonl").write_text("".join(lines[:48]))
    argv = ["--per_device_train_batch_size", "4", "--max_steps", "5", "--max_length", "1024",
            "--pad_to_multiple_of", "32"]
    plan = _plan(folder, [*argv, "--num-processes", "2"], None)
    seen = run_distributed(folder, argv, num_processes=2, tmp_dir=tmp_path, streaming=True)
    assert planned(plan) == observed(seen)


@pytest.mark.parametrize("shuffled", [False, True], ids=["in-order", "reshuffled"])
def test_two_process_short_stream_equals_real_trainer(shuffled: bool, tmp_path: Path) -> None:
    """2 ranks on a stream shorter than max_steps needs: 30 rows make 4 batches of 4 per rank and pass (the last
    chunk completed with the first rows), read again until max_steps, one leftover micro-batch per pass; with
    shuffle_dataset each pass is shuffled anew (IterableDatasetShard's set_epoch reaches the stream) before the
    ranks take their chunks."""
    argv = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "3", "--max_steps", "5",
            "--max_length", "128", "--pad_to_multiple_of", "32", "--eval_strategy", "steps", "--eval_steps", "2",
            "--per_device_eval_batch_size", "16", *(["--shuffle_dataset", "--seed", "2"] if shuffled else [])]
    plan = _plan(TEXT, [*argv, "--num-processes", "2"], TEXT)
    seen = run_distributed(TEXT, argv, eval_path=TEXT, num_processes=2, tmp_dir=tmp_path, streaming=True)
    assert planned(plan) == observed(seen)
