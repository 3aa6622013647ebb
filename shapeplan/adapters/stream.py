"""Streaming runs (`--dataset_streaming`): the prepared rows a run reads from an `IterableDataset`, read lazily, and
the batches each rank makes of them. SFT, DPO, KTO and Reward read a stream the same way.

What TRL and the Trainer do with a stream (trl 1.16, transformers 5.24, accelerate 1.15):

- The trainer's `_prepare_dataset` maps the stream lazily: the same tokenization, truncation and drop of rows as on a
  map-style dataset, row by row. Its batched maps group consecutive rows as on a map-style dataset: SFT's packing
  (`pack_dataset`) packs each run of 1000 prepared rows on its own; KTO unpairs paired rows 1000 at a time and rotates
  the KL completions within each run of `per_device_train_batch_size` prepared rows. SFT's `shuffle_dataset` is a
  buffered shuffle.
- The Trainer gives an iterable dataset no sampler and no `drop_last` (`Trainer._get_dataloader`); it needs
  `max_steps`, and an epoch is then `max_steps x gradient_accumulation_steps` micro-batches read in stream order.
- Each of these trainers forces `dispatch_batches=False` for a stream, so accelerate's `prepare_data_loader` hands
  each rank its own part: `stream.shard(num_processes, rank)` when the stream has at least as many shards (files) as
  ranks (the trainer's preparation then runs on each rank's shard), else `IterableDatasetShard`: ranks take turns
  in chunks of `batch x ranks` rows, the last chunk completed with the first rows.

So the train plan is the first `max_steps x batch x GA x ranks` prepared rows in stream order, and only those are
read (with a batched map, up to the end of the map batch that holds the last one, as TRL reads it); a stream
shorter than that is read whole, and the Trainer passes over it again until max_steps (`TrainLoop.batches_per_pass`).
Before each pass the Trainer calls the stream's `set_epoch(pass)`, and datasets then deals a stream's files in a
new order and reseeds its shuffle buffers: a pass over a stream of several files, or through a shuffle
(`shuffle_dataset`), has its own rows, so each is read as the run reads it. A one-file stream with no shuffle
gives the same rows each pass and is read once.
The eval stream is read whole, as each evaluation reads it.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from ..errors import DatasetError, UsageError
from ..plan.rows import Rows
from ..plan.schedule import TrainLoop
from . import lengths
from .loop import check_walk, sharding
from .sampling import RankBatches, Sharding
from .trl_args import TrainingArgs

T = TypeVar("T")

# (token length, document lengths of a packed row or None)
PreparedRow = tuple[int, tuple[int, ...] | None]


class Reader:
    """Counts the source rows a stream yields to planning (what `analyze` has read from it)."""

    def __init__(self) -> None:
        self.rows_read = 0

    def rows(self, stream: Any) -> Iterator[dict[str, Any]]:
        for row in stream:
            self.rows_read += 1
            yield row

    def count(self, row: dict[str, Any]) -> dict[str, Any]:
        """A `map` function that counts the rows it sees and changes nothing."""
        self.rows_read += 1
        return row


def prepared_rows(stream: Any, tokenizer: Any, config: Any, trainer: Any, *, packing: bool, name: str,
                  reader: Reader, epoch: int, limit: int | None = None) -> Iterator[PreparedRow]:
    """The rows `trainer._prepare_dataset(stream, ...)` yields in pass `epoch`, lazily, as lengths; `limit`: how
    many the caller reads at most (so no source row past them is read). `trainer` is the bare `SFTTrainer` (None
    with skip_prepare_dataset)."""
    if trainer is not None and not config.shuffle_dataset:
        first = list(itertools.islice(iter(stream), 1))
        probe = _chunk(first, stream)
        if first and lengths.fast_path_refusal(probe, tokenizer, config) is None:
            # Packing reads no row past the pack batch (TRL's batched map) holding the last row the run uses.
            chunk_rows = _pack_batch_rows() if packing else lengths.CHUNK_ROWS
            # With no shuffle the pass only orders the files: the source stream read in that pass's order.
            fast = _fast_lengths(in_pass(stream, epoch), tokenizer, config, trainer, packing=packing, name=name,
                                 reader=reader, limit=None if packing else limit, chunk_rows=chunk_rows)
            if not packing:
                return ((length, None) for length in fast)
            return _packed(fast, config)
    return _trl_rows(stream, tokenizer, config, trainer, packing=packing, name=name, reader=reader, epoch=epoch)


def in_pass(stream: Any, epoch: int) -> Any:
    """`stream` as the Trainer's pass `epoch` reads it (its `set_epoch`), leaving `stream` itself as it was."""
    passed = copy.copy(stream)
    passed._epoch = epoch  # set_epoch updates a value it may share with `stream` in place
    return passed


def _chunk(rows: list[dict[str, Any]], stream: Any) -> Any:
    """A map-style `Dataset` of streamed rows, with the stream's own features (so absent keys stay None)."""
    import datasets

    return datasets.Dataset.from_list(rows, features=stream.features)


def _fast_lengths(stream: Any, tokenizer: Any, config: Any, trainer: Any, *, packing: bool, name: str,
                  reader: Reader, limit: int | None, chunk_rows: int) -> Iterator[int]:
    """Prepared lengths before packing, through the fast length path `chunk_rows` source rows at a time: tokenize,
    then (unpacked) truncate and drop rows left without a trainable token, as TRL does row by row. A source row
    yields at most one prepared row, so reading no more than the `limit` rows still wanted never reads past them."""
    unpacked = copy.copy(config)
    unpacked.shuffle_dataset = False
    if packing:
        unpacked.max_length = None  # TRL does not truncate rows it packs
    source = reader.rows(stream)
    wanted = limit
    while wanted != 0:
        chunk = list(itertools.islice(source, chunk_rows if wanted is None else min(wanted, chunk_rows)))
        if not chunk:
            return
        rows, _ = lengths.fast_prepared_rows(trainer, _chunk(chunk, stream), tokenizer, unpacked, packing=False,
                                             name=name, workers=1)
        if wanted is not None:
            wanted -= len(rows.lengths)
        yield from rows.lengths


def _pack_batch_rows() -> int:
    """The rows `pack_dataset`'s batched `map` packs together on a stream: it passes no batch_size, so datasets'
    default for `IterableDataset.map`."""
    import inspect

    import datasets

    default: int = inspect.signature(datasets.IterableDataset.map).parameters["batch_size"].default
    return default


def _packed(row_lengths: Iterator[int], config: Any) -> Iterator[PreparedRow]:
    """TRL's `pack_dataset` on a stream of value-less rows of the given lengths: its batched `map` groups the rows
    exactly as on the real stream, so the packed rows are the run's."""
    import datasets
    from datasets.iterable_dataset import ExamplesIterable
    from trl.data_utils import pack_dataset

    def examples(**_: Any) -> Iterator[tuple[int, dict[str, list[None]]]]:
        for key, length in enumerate(row_lengths):
            yield key, {"input_ids": [None] * length}  # list<null>: a length and no values

    features = datasets.Features({"input_ids": datasets.List(datasets.Value("null"))})
    stream = datasets.IterableDataset(ExamplesIterable(examples, {}), info=datasets.DatasetInfo(features=features))
    for row in pack_dataset(stream, config.max_length, config.packing_strategy, {}):
        documents = row.get("seq_lengths")
        yield len(row["input_ids"]), None if documents is None else tuple(documents)


def _trl_rows(stream: Any, tokenizer: Any, config: Any, trainer: Any, *, packing: bool, name: str,
              reader: Reader, epoch: int) -> Iterator[PreparedRow]:
    """TRL's own `_prepare_dataset` on the stream in pass `epoch`, for what the fast path does not follow
    (shuffle_dataset's buffered shuffle, assistant-only masks, tokenized data...)."""
    source = counted(stream, reader)
    prepared = source if trainer is None else trainer._prepare_dataset(source, tokenizer, config, packing, None, name)
    for row in in_pass(prepared, epoch):
        if "input_ids" not in row:
            raise DatasetError(f"the {name} dataset has no 'input_ids' column after preparation; with "
                               "skip_prepare_dataset the dataset must be tokenized already")
        documents = row.get("seq_lengths")
        yield len(row["input_ids"]), None if documents is None else tuple(documents)


def counted(stream: Any, reader: Reader) -> Any:
    """The stream, counting in `reader` each source row it yields."""
    return stream.map(reader.count, features=stream.features)


def rank_streams(stream: Any, sharding: Sharding) -> list[Any]:
    """The stream each rank reads when accelerate shards it by files (`stream.shard`, never under split_batches),
    else the one shared stream (`IterableDatasetShard` splits it by rows)."""
    ranks = sharding.num_processes
    if ranks > 1 and not sharding.split_batches and stream.n_shards >= ranks:
        return [stream.shard(num_shards=ranks, index=rank) for rank in range(ranks)]
    return [stream]


def sft_rows(prepared: Sequence[PreparedRow]) -> Rows:
    """SFT's `Rows` of prepared rows."""
    documents = tuple(d for _, d in prepared if d is not None)
    return Rows(lengths=tuple(length for length, _ in prepared),
                documents=documents if prepared and len(documents) == len(prepared) else None)


# (a rank's stream, how many prepared rows are wanted or None for all, the reader counting source rows, the pass
# (`in_pass`)) -> the stream's prepared rows in that pass, as the planner's items (SFT's PreparedRow, a preference
# trainer's column lengths), lazily
Read = Callable[[Any, int | None, Reader, int], Iterator[T]]


@dataclass(frozen=True)
class Streamed(Generic[T]):
    """What the run reads of a stream: every rank's prepared rows (rank after rank when sharded by files, else the one
    shared stream's) and each rank's batches of indices into them."""

    rows: list[T]
    batches: RankBatches
    whole: bool  # the stream ended before the rows wanted: it was read whole


def read(dataset: Any, read_rows: Read[T], *, sharding: Sharding, batch_size: int, option: str,
         per_rank: int | None, reader: Reader, check: Callable[[int], None], epoch: int = 0) -> Streamed[T]:
    """The first `per_rank` prepared rows each rank reads in pass `epoch` (all of them when None) and their
    batches of the dataloader's `batch_size` (set by `option`; a rank's share of it under split_batches); `check`
    gets the prepared rows of each part read (to refuse a part whose every row was dropped)."""
    streams = rank_streams(dataset, sharding)
    wanted = None if per_rank is None else per_rank * (1 if len(streams) > 1 else sharding.num_processes)
    parts = []
    for part in streams:
        parts.append(list(itertools.islice(read_rows(part, wanted, reader, epoch), wanted)))
        check(len(parts[-1]))
    return Streamed(rows=list(itertools.chain.from_iterable(parts)),
                    batches=rank_batches([len(p) for p in parts], batch_size=batch_size, option=option,
                                         sharding=sharding),
                    whole=wanted is None or any(len(p) < wanted for p in parts))


def rank_batches(sizes: list[int], *, batch_size: int, option: str, sharding: Sharding) -> RankBatches:
    """Each rank's batches of indices into the parts' rows joined, as the prepared DataLoader of `batch_size` (set
    by `option`) gives them: one part per rank (sharded by files) or one shared part (split by
    `IterableDatasetShard` in chunks of `batch_size` x ranks, or of `batch_size` cut in one slice per rank under
    split_batches; the last chunk completed with the first rows). The Trainer sets no drop_last for a stream."""
    from accelerate.data_loader import IterableDatasetShard

    ranks = sharding.num_processes
    if len(sizes) == 1 and ranks > 1:
        # IterableDatasetShard iterates any iterable: here the row indices, in stream order.
        shards = (IterableDatasetShard(range(sizes[0]), batch_size=batch_size, drop_last=False,
                                       num_processes=ranks, process_index=rank, split_batches=sharding.split_batches)
                  for rank in range(ranks))
        per_rank = [list(shard) for shard in shards]
    else:
        # `starts` has one more item than `sizes` (the end), which zip leaves out
        starts = itertools.accumulate(sizes, initial=0)
        per_rank = [list(range(start, start + size)) for start, size in zip(starts, sizes, strict=False)]
    # prepare_data_loader gives the rank's DataLoader a batch_size of its share
    size = sharding.rank_batch_size(batch_size, option)
    return [[order[i:i + size] for i in range(0, len(order), size)] for order in per_rank]


def check_run(args: TrainingArgs) -> None:
    """What the Trainer and accelerate refuse, or shapeplan does not plan, for a streamed train dataset."""
    config = args.training
    if config.max_steps <= 0:
        raise UsageError("a streamed dataset has no length, so the Trainer refuses it without max_steps; pass "
                         "--max_steps N")
    # The trainer forces dispatch_batches=False for a stream, and no batch sampler (even_batches) shards it.


@dataclass(frozen=True)
class Passes(Generic[T]):
    """The train rows a streaming run reads: every pass's prepared rows, pass after pass (one pass unless the
    stream is shorter than max_steps needs and its passes differ), and each pass's batches of indices into them."""

    rows: list[T]
    passes: list[RankBatches]
    rows_per_pass: int  # the first pass's prepared rows

    def epoch_batches(self, epoch: int) -> RankBatches:
        """Pass `epoch`'s batches (a stream read once repeats its one pass)."""
        return self.passes[min(epoch, len(self.passes) - 1)]


def read_train(dataset: Any, args: TrainingArgs, read_rows: Read[T], check: Callable[[int], None], *,
               shuffled: bool = False) -> tuple[Passes[T], TrainLoop, str]:
    """The train rows and batches a streaming run reads, its loop (max_steps x GA micro-batches per rank, or passes
    over a stream shorter than that), and the plan's warning saying what was read. `shuffled`: the trainer's
    preparation shuffles the stream (SFT's shuffle_dataset), so each pass has its own order."""
    config = args.training
    ga = config.gradient_accumulation_steps
    micro = config.max_steps * ga
    reader = Reader()
    shards = sharding(args)
    batch_size, option = config.per_device_train_batch_size, "per_device_train_batch_size"

    def read_pass(epoch: int) -> Streamed[T]:
        return read(dataset, read_rows, sharding=shards, batch_size=batch_size, option=option,
                    per_rank=micro * shards.rank_batch_size(batch_size, option), reader=reader, check=check,
                    epoch=epoch)

    passes = [read_pass(0)]
    # The Trainer's epoch over a stream is max_steps x GA micro-batches (`set_initial_training_values`).
    loop = TrainLoop(steps_in_epoch=micro, gradient_accumulation_steps=ga, num_train_epochs=config.num_train_epochs,
                     max_steps=config.max_steps)
    again = ""
    if passes[0].whole:  # the stream ends before max_steps: the Trainer reads it again, pass after pass
        lengths = [pass_length(passes[0].batches, gradient_accumulation_steps=ga)]
        check_walk(args, micro_batches=micro, per_pass=lengths[0])
        if shuffled or any(part.n_shards > 1 for part in rank_streams(dataset, shards)):
            # Each pass steps once per GA of its micro-batches (the leftover ones join the next pass's first step).
            while sum(length // ga for length in lengths) < config.max_steps:
                passes.append(read_pass(len(passes)))
                lengths.append(pass_length(passes[-1].batches, gradient_accumulation_steps=ga))
            again = f", the whole stream {len(passes)} times, each pass in its own order"
        else:
            again = ", the whole stream, again from its start until max_steps"
        loop = replace(loop, batches_per_pass=tuple(lengths))
    warning = (f"streaming: the run reads the first {len(passes[0].rows)} prepared train rows{again} "
               f"({reader.rows_read} source rows read to plan them)")
    return _joined(passes), loop, warning


def _joined(passes: list[Streamed[T]]) -> Passes[T]:
    """The passes' rows one after the other, each pass's batches shifted to its own rows."""
    offsets = itertools.accumulate((len(p.rows) for p in passes), initial=0)
    return Passes(rows=[row for p in passes for row in p.rows],
                  passes=[[[[i + offset for i in batch] for batch in rank] for rank in p.batches]
                          for p, offset in zip(passes, offsets, strict=False)],
                  rows_per_pass=len(passes[0].rows))


def read_eval(dataset: Any, args: TrainingArgs, read_rows: Read[T], check: Callable[[int], None]) -> Streamed[T]:
    """The eval stream, read whole as each evaluation reads it, and its batches."""
    return read(dataset, read_rows, sharding=sharding(args), batch_size=args.training.per_device_eval_batch_size,
                option="per_device_eval_batch_size", per_rank=None, reader=Reader(), check=check)


def pass_length(batches: RankBatches, *, gradient_accumulation_steps: int) -> int:
    """The micro-batches per rank of one pass over a stream shorter than max_steps needs, which the Trainer reads
    again from its start (a new epoch) until max_steps: what every rank's pass must have in common."""
    lengths = {len(rank) for rank in batches}
    if len(lengths) > 1:
        raise UsageError(f"the ranks' shards of the stream hold {' and '.join(map(str, sorted(lengths)))} batches, "
                         "and the stream is shorter than max_steps needs: the ranks would fall out of step when "
                         "one starts its next pass; lower --max_steps or stream files of equal length")
    (length,) = lengths
    if length < gradient_accumulation_steps:
        raise UsageError(f"the stream holds {length} batches per rank, fewer than gradient_accumulation_steps="
                         f"{gradient_accumulation_steps}: the Trainer never completes an optimizer step and reads it "
                         "again without end; stream more data or lower --gradient_accumulation_steps")
    return length
