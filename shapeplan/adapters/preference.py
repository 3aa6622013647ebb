"""What the DPO, KTO and Reward adapters share: checking columns, running a trainer's own `_prepare_dataset` on a
bare instance (on a map-style dataset, or lazily on a stream), reading token lengths off the prepared rows, and
replaying the loops over them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Sized
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from ..errors import DatasetError, UsageError
from ..plan.batches import RankBatches, RunInfo
from ..plan.schedule import TrainLoop
from . import stream
from .common import (
    RunData,
    load_run_data,
    recorded_config,
    run_fingerprint,
    streamed,
    trl_preparing,
    versions,
)
from .loop import eval_schedule, eval_steps_of, sequential_pass, train_schedule
from .trl_args import TrainingArgs

R = TypeVar("R", bound=Sized)  # the trainer's prepared rows (PairedRows, UnpairedRows)


def check_columns(dataset: Any, trainer: str, name: str, accepted: Sequence[Sequence[str]]) -> None:
    """Raise unless the dataset has every column of one of the `accepted` sets (`trainer`: its name, for people)."""
    from trl.data_utils import get_dataset_column_names

    columns = set(get_dataset_column_names(dataset))  # a stream may not know its columns before its first row
    if any(set(needed) <= columns for needed in accepted):
        return
    wanted = " or ".join("/".join(f"'{c}'" for c in needed) for needed in accepted)
    raise DatasetError(f"the {name} dataset has no {wanted} columns (it has {', '.join(sorted(columns)) or 'none'}); "
                       f"{trainer} needs {wanted}")


@dataclass(frozen=True)
class Preparation(Generic[R]):
    """How one trainer's data becomes the planner's rows: TRL's own `_prepare_dataset` on a bare trainer, then the
    prepared columns the rows are made of, list columns by their lengths (`lengths`) and others by value
    (`values`)."""

    trainer: str  # its name, for people
    accepted: Sequence[Sequence[str]]  # the column sets it prepares (`check_columns`)
    bare: Any  # the bare TRL trainer whose `_prepare_dataset` runs
    lengths: tuple[str, ...]
    build: Callable[[list[list[Any]]], R]  # the columns' lengths, then values, in row order -> the rows
    dropped_because: str  # why preparation drops a row, before "max_length=N"
    values: tuple[str, ...] = ()
    rows_per_example: Callable[[Any], int] = lambda dataset: 1  # prepared rows one input row makes at most

    def map_style(self, dataset: Any, tokenizer: Any, config: Any, name: str) -> tuple[R, int]:
        """The rows of a map-style dataset, and how many rows preparation dropped."""
        import pyarrow.compute as pc

        check_columns(dataset, self.trainer, name, self.accepted)
        with trl_preparing(name):
            prepared = self.bare._prepare_dataset(dataset, tokenizer, config, name)
        # Through the arrow formatter, so the indices mapping that `filter` leaves is honoured.
        table = prepared.select_columns([*self.lengths, *self.values]).with_format("arrow")[:]
        columns = [pc.list_value_length(table.column(c)).to_pylist() for c in self.lengths]
        columns += [table.column(c).to_pylist() for c in self.values]
        rows = self.build(columns)
        check_not_empty(len(rows), name, config.max_length, self.dropped_because)
        return rows, len(dataset) * self.rows_per_example(dataset) - len(rows)

    def stream_reader(self, dataset: Any, tokenizer: Any, config: Any, name: str) -> stream.Read[tuple[Any, ...]]:
        """How a rank's stream of `dataset` yields its prepared rows (each its columns' lengths, then values)."""
        check_columns(dataset, self.trainer, name, self.accepted)

        def read(part: Any, limit: int | None, reader: stream.Reader, epoch: int) -> Iterator[tuple[Any, ...]]:
            with trl_preparing(name):
                # lazy: the trainer's maps run on the rows as they are read
                prepared = self.bare._prepare_dataset(stream.counted(part, reader), tokenizer, config, name)
                for row in stream.in_pass(prepared, epoch):
                    yield (*(len(row[c]) for c in self.lengths), *(row[c] for c in self.values))
        return read

    def streamed(self, items: list[tuple[Any, ...]]) -> R:
        columns = [list(column) for column in zip(*items, strict=True)]
        return self.build(columns or [[] for _ in (*self.lengths, *self.values)])


def check_not_empty(num_rows: int, name: str, max_length: int | None, why: str) -> None:
    if num_rows == 0:
        raise DatasetError(f"every row of the {name} dataset was dropped: {why} max_length={max_length}; "
                           "raise --max_length")


@dataclass(frozen=True)
class PreparedRun(Generic[R]):
    """A run's prepared rows, train loop, eval loop and plan metadata: everything but the trainer's collate rule."""

    train_rows: R
    epoch_batches: Callable[[int], RankBatches]
    loop: TrainLoop
    info: RunInfo
    eval_rows: R | None = None
    eval_batches: RankBatches = ()
    eval_steps: list[int] = field(default_factory=list)


def prepare_run(
    args: TrainingArgs,
    argv: list[str],
    eval_source: str | None,
    preparation: Callable[[Any, Any], Preparation[R]],
    setup_tokenizer: Callable[[Any, Any], None] | None = None,
) -> PreparedRun[R]:
    """Load the run's data, prepare it as `preparation(tokenizer, config)` says, and replay the train and eval loops
    over the prepared rows."""
    config = args.training
    streaming = streamed(args)
    if streaming:
        stream.check_run(args)
        if getattr(config, "precompute_ref_log_probs", False):  # `_precompute_ref_logps` raises on an IterableDataset
            raise UsageError(f"TRL's {args.method} trainer refuses precompute_ref_log_probs=True on a streamed dataset "
                             "(an IterableDataset); drop --precompute_ref_log_probs or --dataset_streaming")
    data = load_run_data(args, eval_source=eval_source)
    if setup_tokenizer is not None:
        setup_tokenizer(data.tokenizer, config)
    prep = preparation(data.tokenizer, config)
    if streaming:
        return _stream_run(args, argv, data, prep)
    train_rows, dropped = prep.map_style(data.train, data.tokenizer, config, "train")
    epoch_batches, loop = train_schedule(args, len(train_rows))
    info = RunInfo(
        method=args.method,
        rows=len(train_rows),
        pad_to_multiple_of=config.pad_to_multiple_of,
        dropped_rows=dropped,
        config=recorded_config(args, argv),
        versions=versions(),
        fingerprint=run_fingerprint(data),
    )
    if data.eval is None:
        return PreparedRun(train_rows=train_rows, epoch_batches=epoch_batches, loop=loop, info=info)
    eval_rows, _ = prep.map_style(data.eval, data.tokenizer, config, "eval")
    eval_batches, eval_steps = eval_schedule(args, loop, len(eval_rows))
    return PreparedRun(train_rows=train_rows, epoch_batches=epoch_batches, loop=loop, info=info, eval_rows=eval_rows,
                       eval_batches=eval_batches, eval_steps=eval_steps)


def _stream_run(args: TrainingArgs, argv: list[str], data: RunData, prep: Preparation[R]) -> PreparedRun[R]:
    """A streaming run (see `shapeplan.adapters.stream`): the stream's first prepared rows in stream order, each rank's
    batches of them, and the eval stream read whole at each evaluation."""
    config = args.training

    def check(name: str) -> Callable[[int], None]:
        return lambda rows: check_not_empty(rows, name, config.max_length, prep.dropped_because)

    train, loop, read = stream.read_train(data.train, args, prep.stream_reader(data.train, data.tokenizer, config,
                                                                               "train"), check("train"))
    train_rows = prep.streamed(train.rows)
    info = RunInfo(method=args.method, rows=train.rows_per_pass, pad_to_multiple_of=config.pad_to_multiple_of,
                   config=recorded_config(args, argv), versions=versions(), fingerprint=run_fingerprint(data),
                   warnings=(read,))
    run = PreparedRun(train_rows=train_rows, epoch_batches=train.epoch_batches, loop=loop, info=info)
    if data.eval is None:
        return run
    evaluated = stream.read_eval(data.eval, args, prep.stream_reader(data.eval, data.tokenizer, config, "eval"),
                                 check("eval"))
    return replace(run, eval_rows=prep.streamed(evaluated.rows), eval_batches=evaluated.batches,
                   eval_steps=eval_steps_of(args, loop))


PRECOMPUTE_CACHED = ("ref_precompute shapes are met only when TRL finds no cached reference log-probs for this "
                     "data and model (a rerun with both unchanged skips the pass)")


def plan_inputs(args: TrainingArgs, run: PreparedRun[Any]) -> dict[str, Any]:
    """What DPO's and KTO's plan functions take from the prepared run, besides their layout: its rows, train and
    eval loops, info (warning of a reference precompute pass), and the precompute passes' batches."""
    train_precompute, eval_precompute = precompute_batches(args, run)
    precompute = args.training.precompute_ref_log_probs
    return dict(train_rows=run.train_rows, loop=run.loop, epoch_batches=run.epoch_batches,
                info=replace(run.info, warnings=(*run.info.warnings, PRECOMPUTE_CACHED)) if precompute else run.info,
                eval_rows=run.eval_rows, eval_batches=run.eval_batches, eval_steps=run.eval_steps,
                precompute_batches=train_precompute, eval_precompute_batches=eval_precompute)


def precompute_batches(args: TrainingArgs, run: PreparedRun[Any]) -> tuple[RankBatches, RankBatches]:
    """The train and eval batches of the reference precompute pass, or none without `precompute_ref_log_probs`."""
    config = args.training
    if not config.precompute_ref_log_probs:
        return (), ()
    size = config.precompute_ref_batch_size
    train = sequential_pass(args, len(run.train_rows), size or config.per_device_train_batch_size,
                            "precompute_ref_batch_size" if size else "per_device_train_batch_size")
    if run.eval_rows is None:
        return train, ()
    return train, sequential_pass(args, len(run.eval_rows), size or config.per_device_eval_batch_size,
                                  "precompute_ref_batch_size" if size else "per_device_eval_batch_size")
