"""Streaming GRPO / RLOO / Distillation planning: the order the planner reads from a stream is the order the run's
prepared DataLoader yields (TRL's shuffle and `repeat_iterable_dataset`, accelerate's `prepare_data_loader` for each
rank, the Trainer's `set_epoch` per pass), and planning reads only what the run consumes plus the shuffle buffer."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from shapeplan.adapters import generation_stream
from shapeplan.adapters.data import load_dataset_source
from shapeplan.adapters.trl_args import parse_training_args
from shapeplan.errors import DatasetError, ShapeplanError, UsageError
from shapeplan.services.analyze import analyze
from shapeplan.services.trainers import TRAINERS
from tests.conftest import CAPYBARA, TINY_MODEL, TLDR

GRPO = ["--per_device_train_batch_size", "2", "--num_generations", "2", "--gradient_accumulation_steps", "2"]


class _Numbering:
    """A trainer whose `_tokenize_prompts` gives a prompt "N ..." N + 1 tokens: lengths name the rows (without
    environments, as `bare_trainer` sets it for a run without them)."""

    environment_factories = None

    def _tokenize_prompts(self, prompts: list[str]) -> tuple[list[list[int]], None, None]:
        return [[0] * (int(p.split()[0]) + 1) for p in prompts], None, None


def _write(path: Path, numbers: range) -> None:
    path.write_text("".join(json.dumps({"prompt": f"{n} words"}) + "\n" for n in numbers))


def _source(tmp_path: Path, kind: str) -> Path:
    """One file of 900 rows, a folder of 3 files of 300 (3 shards: a rank each, and the shuffle interleaves them),
    or one file of 11 rows (shorter than the runs below need)."""
    if kind == "files":
        folder = tmp_path / "files"
        folder.mkdir()
        for i in range(3):
            _write(folder / f"part{i}.jsonl", range(300 * i, 300 * (i + 1)))
        return folder
    path = tmp_path / f"{kind}.jsonl"
    _write(path, range(900 if kind == "file" else 11))
    return path


def _real_passes(source: Any, args: Any, passes: int, micro: int) -> list[list[list[list[int]]]]:
    """Each pass's per-rank batches of row numbers, from the run's own DataLoader: GRPOTrainer.get_train_dataloader's
    pipeline, accelerate's prepare_data_loader per rank, set_epoch as the Trainer calls it."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader
    from trl.trainer.utils import repeat_iterable_dataset

    config = args.training
    dataset = source.shuffle(seed=config.seed) if config.shuffle_dataset else source
    dataset = repeat_iterable_dataset(dataset, mini_repeat_count=config.num_generations,
                                      batch_size=config.generation_batch_size // config.num_generations,
                                      repeat_count=config.num_iterations * config.steps_per_generation)
    out: list[list[list[list[int]]]] = []
    for epoch in range(passes):
        ranks = []
        for rank in range(args.num_processes):
            loader = prepare_data_loader(
                DataLoader(dataset, batch_size=config.per_device_train_batch_size * config.steps_per_generation),
                num_processes=args.num_processes, process_index=rank, dispatch_batches=False, put_on_device=False,
                split_batches=config.accelerator_config.split_batches)
            loader.set_epoch(epoch)
            ranks.append([[int(p.split()[0]) for p in batch["prompt"]] for batch in itertools.islice(loader, micro)])
        out.append(ranks)
    return out


@pytest.mark.parametrize(("kind", "ranks", "shuffle", "split"), [
    *itertools.product(["file", "files", "short"], [1, 2], [True, False], [False]),
    # split_batches: the ranks share each dataloader batch (never sharded by files)
    *itertools.product(["file", "files", "short"], [2], [True], [True]),
])
def test_the_planned_order_is_the_prepared_dataloaders(kind: str, ranks: int, shuffle: bool, split: bool,
                                                        tmp_path: Path) -> None:
    source = load_dataset_source(str(_source(tmp_path, kind)), streaming=True)["train"]
    args = parse_training_args(TRAINERS["grpo"], ["--dataset_name", "x", "--model_name_or_path", str(TINY_MODEL), *GRPO,
                                        "--max_steps", "7", "--seed", "5", "--shuffle_dataset", str(shuffle),
                                        "--num_processes", str(ranks),
                                        "--accelerator_config", json.dumps({"split_batches": split})])
    config = args.training
    repeat = generation_stream.Repeat(config.num_generations, config.generation_batch_size // config.num_generations,
                                      config.num_iterations * config.steps_per_generation)
    batch_size = config.per_device_train_batch_size * config.steps_per_generation
    order, loop, _ = generation_stream.train_order(args, _Numbering(), source, repeat=repeat, batch_size=batch_size,
                                                   option="per_device_train_batch_size x steps_per_generation")
    planned = [[[[order.lengths[i] - 1 for i in batch] for batch in rank] for rank in epoch] for epoch in order.passes]
    micro = config.max_steps * config.gradient_accumulation_steps
    assert planned == _real_passes(source, args, len(order.passes), micro)
    # the short stream is read again (each pass reshuffled when shuffling), the others once
    assert (len(order.passes) > 1, bool(loop.batches_per_pass)) == (kind == "short",) * 2


def test_planning_reads_only_what_the_run_consumes_and_the_shuffle_buffer() -> None:
    """5 steps of 2 unique prompts from streams of 5,000 and 50,000 rows: the same rows are read from either, the
    1000 the shuffle buffer fills first plus the few it yields."""
    import datasets

    read: list[int] = []

    def rows(count: int) -> Any:
        def generate() -> Any:
            for n in range(count):
                read.append(n)
                yield {"prompt": f"{n} words"}
        return datasets.IterableDataset.from_generator(generate)

    args = parse_training_args(TRAINERS["grpo"], ["--dataset_name", "x", "--model_name_or_path", str(TINY_MODEL), *GRPO,
                                        "--max_steps", "5"])
    repeat = generation_stream.Repeat(2, 2, 2)
    counts = []
    for count in (5_000, 50_000):
        read.clear()
        order, _, _ = generation_stream.train_order(args, _Numbering(), rows(count), repeat=repeat, batch_size=4,
                                                    option="per_device_train_batch_size x steps_per_generation")
        assert len(order.lengths) == 10
        counts.append(len(read))
    assert counts[0] == counts[1] and 1000 < counts[0] <= 1000 + 10 + 2, counts


@pytest.mark.parametrize(("method", "data", "argv", "error", "message"), [
    ("grpo", TLDR, [], UsageError,
     "a streamed dataset has no length, so the Trainer refuses it without max_steps; pass --max_steps N"),
    ("rloo", TLDR, ["--max_steps", "2", "--accelerator_config", '{"dispatch_batches": true}'], UsageError,
     "TRL's rloo trainer refuses dispatch_batches=True on a streamed dataset"),
    ("grpo", TLDR, ["--max_steps", "2", "--num_processes", "2", "--per_device_train_batch_size", "2",
                    "--steps_per_generation", "1", "--gradient_accumulation_steps", "1", "--num_generations", "4",
                    "--accelerator_config", '{"split_batches": true}'],
     UsageError, "with split_batches all ranks together hold per_device_train_batch_size x steps_per_generation=2 "
                 "completions, which the trainer groups by 4 generations"),
    ("grpo", None, ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "2"],
     DatasetError, "the train stream holds fewer prompts than one generation batch (4 unique prompts)"),
    ("grpo", CAPYBARA, ["--max_steps", "2"], DatasetError,
     "the train stream has no 'prompt' column (it has source, messages)"),
])
def test_what_a_stream_refuses(method: str, data: Path | None, argv: list[str], error: type[ShapeplanError],
                               message: str, tmp_path: Path) -> None:
    """One line each: usage errors (exit 2) for what TRL or the Trainer refuse, dataset errors (exit 1) for data."""
    if data is None:
        data = tmp_path / "three.jsonl"
        data.write_text("".join(TLDR.read_text().splitlines(keepends=True)[:3]))
    with pytest.raises(error) as info:
        analyze(method, ["--dataset_name", str(data), "--model_name_or_path", str(TINY_MODEL), "--dataset_streaming",
                         *argv], use_cache=False)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("method", ["sft", "grpo"])
def test_histogram_and_advise_refuse_a_stream(method: str) -> None:
    """They read every row's length: a stream is refused in one line, not planned whole nor misreported."""
    from shapeplan.adapters.row_lengths import train_lengths

    with pytest.raises(UsageError, match=r"^--histogram and advise read the length of every train row"):
        train_lengths(TRAINERS[method], ["--dataset_name", str(TLDR), "--model_name_or_path", str(TINY_MODEL),
                               "--dataset_streaming", "--max_steps", "2"])
