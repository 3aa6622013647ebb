"""Streaming SFT planning: the fast length path on a stream gives exactly the rows TRL's own lazy preparation
yields, and planning reads only the source rows the run consumes."""

from __future__ import annotations

from pathlib import Path

import pytest

from shapeplan.adapters import sft, stream
from shapeplan.adapters.data import load_dataset_source, load_tokenizer
from shapeplan.adapters.trl_args import parse_training_args
from shapeplan.services.analyze import analyze
from shapeplan.services.trainers import TRAINERS
from tests.conftest import CAPYBARA, TINY_MODEL, TLDR, write_short_text_rows


def _config(argv: list[str]):  # type: ignore[no-untyped-def]
    return parse_training_args(TRAINERS["sft"], ["--dataset_name", "x", "--model_name_or_path", str(TINY_MODEL),
                                                 *argv]).training


# (data, TRL options): plain text across TRL's 1000-row pack batches; conversational; prompt-completion rows whose
# completion-only loss drops some rows at max_length 128
CASES = {
    "text-truncated": (None, ["--max_length", "40"]),
    "text-bfd": (None, ["--packing", "--max_length", "100"]),
    "text-bfd-split": (None, ["--packing", "--packing_strategy", "bfd_split", "--max_length", "50"]),
    "text-wrapped": (None, ["--packing", "--packing_strategy", "wrapped", "--max_length", "100"]),
    "conversational-truncated": (CAPYBARA, ["--max_length", "256"]),
    "prompt-completion-drops": (TLDR, ["--max_length", "128"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fast_path_on_a_stream_equals_trl_preparation(name: str, tmp_path: Path) -> None:
    data, argv = CASES[name]
    source = data if data is not None else write_short_text_rows(tmp_path / "short.jsonl", 2300)
    config = _config(argv)
    tokenizer = load_tokenizer(str(TINY_MODEL))
    rows = load_dataset_source(str(source), streaming=True)["train"]
    trainer = sft._preparer(rows, tokenizer, config, packing=config.packing)
    fast_reader, trl_reader = stream.Reader(), stream.Reader()
    fast = list(stream.prepared_rows(rows, tokenizer, config, trainer, packing=config.packing, name="train",
                                     reader=fast_reader, epoch=1))
    trl = list(stream._trl_rows(rows, tokenizer, config, trainer, packing=config.packing, name="train",
                                reader=trl_reader, epoch=1))
    assert fast == trl
    assert fast_reader.rows_read == sum(1 for _ in rows)
    if name == "prompt-completion-drops":
        assert len(fast) < fast_reader.rows_read  # rows were dropped, and the fast path dropped the same ones


def test_planning_reads_only_the_rows_the_run_consumes(tmp_path: Path) -> None:
    """max_steps 5 x batch 3 x GA 2 x 2 ranks = 60 rows of a 2300-row stream; no row is dropped, so 60 are read."""
    source = write_short_text_rows(tmp_path / "short.jsonl", 2300)
    plan = analyze("sft", ["--dataset_name", str(source), "--model_name_or_path", str(TINY_MODEL),
                           "--dataset_streaming", "--max_steps", "5", "--per_device_train_batch_size", "3",
                           "--gradient_accumulation_steps", "2", "--num_processes", "2", "--max_length", "64"],
                   use_cache=False)
    assert (plan.stats.rows, plan.stats.micro_batches, plan.stats.optimizer_steps) == (60, 20, 5)
    assert any("first 60 prepared train rows (60 source rows read" in w for w in plan.warnings), plan.warnings


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
# method -> (data, TRL options): DPO cutting prompts at max_length 256 (drops rows); KTO on paired rows (unpaired
# into two, a batched map) with KL rows rotated within runs of 3; Reward dropping rows with a side over 384
PREFERENCE = {
    "dpo": (FIXTURES / "preference-explicit.jsonl", ["--max_length", "256"]),
    "kto": (FIXTURES / "preference-conversational.jsonl", ["--max_length", "128", "--per_device_train_batch_size",
                                                           "3"]),
    "reward": (FIXTURES / "preference-conversational.jsonl", ["--max_length", "384"]),
}


@pytest.mark.parametrize("method", sorted(PREFERENCE))
def test_preference_stream_rows_equal_the_map_style_preparation(method: str) -> None:
    """TRL's preparation run lazily on a stream yields the rows it makes of the map-style dataset, in order."""
    import importlib

    data, argv = PREFERENCE[method]
    config = parse_training_args(TRAINERS[method], ["--dataset_name", "x", "--model_name_or_path", str(TINY_MODEL),
                                          *argv]).training
    adapter = importlib.import_module(f"shapeplan.adapters.{method}")
    tokenizer = load_tokenizer(str(TINY_MODEL))
    prep = adapter.preparation(tokenizer, config)
    expected, dropped = prep.map_style(load_dataset_source(str(data))["train"], tokenizer, config, "train")
    rows = load_dataset_source(str(data), streaming=True)["train"]
    reader = stream.Reader()
    streamed = prep.streamed(list(prep.stream_reader(rows, tokenizer, config, "train")(rows, None, reader, 0)))
    assert streamed == expected
    assert dropped > 0 or method == "kto"  # the configs drop rows (KTO's prompts all fit), and the stream the same
    assert reader.rows_read >= 40  # the whole stream was read


def test_preference_planning_reads_only_the_rows_the_run_consumes(tmp_path: Path) -> None:
    """DPO, max_steps 3 x batch 2 x 2 ranks = 12 rows of a 5000-row stream: planning reads them and the first row
    again where TRL's preparation looks at it, never the rest."""
    import json

    source = tmp_path / "pairs.jsonl"
    with source.open("w") as f:
        for i in range(5000):
            f.write(json.dumps({"prompt": f"Question {i}:", "chosen": " yes" * (i % 7 + 1),
                                "rejected": " no" * (i % 5 + 1)}) + "\n")
    plan = analyze("dpo", ["--dataset_name", str(source), "--model_name_or_path", str(TINY_MODEL),
                           "--dataset_streaming", "--max_steps", "3", "--per_device_train_batch_size", "2",
                           "--num_processes", "2"], use_cache=False)
    assert (plan.stats.rows, plan.stats.micro_batches, plan.stats.optimizer_steps) == (12, 6, 3)
    (warning,) = [w for w in plan.warnings if w.startswith("streaming:")]
    read = int(warning.split("(")[1].split()[0])
    assert 12 <= read < 20, warning
