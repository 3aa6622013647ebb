"""What the DPO, KTO and Reward adapters share: checking columns, running a trainer's own `_prepare_dataset` on a
bare instance, reading token lengths off the prepared rows, and replaying the loops over them."""

from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from ..errors import DatasetError, UsageError, first_line
from ..plan.batches import RankBatches, RunInfo
from ..plan.schedule import TrainLoop
from .common import load_run_data, recorded_config, run_fingerprint, versions
from .loop import eval_schedule, sequential_pass, train_schedule
from .trl_args import TrainingArgs

R = TypeVar("R", bound=Sized)  # the trainer's prepared rows (PairedRows, UnpairedRows)


def check_columns(dataset: Any, trainer: str, name: str, accepted: Sequence[Sequence[str]]) -> None:
    """Raise unless the dataset has every column of one of the `accepted` sets (`trainer`: its name, for people)."""
    columns = set(dataset.column_names)
    if "image" in columns or "images" in columns:
        raise UsageError(f"the {name} dataset has images; vision-language {trainer} is not planned yet")
    if any(set(needed) <= columns for needed in accepted):
        return
    wanted = " or ".join("/".join(f"'{c}'" for c in needed) for needed in accepted)
    raise DatasetError(f"the {name} dataset has no {wanted} columns (it has {', '.join(sorted(columns)) or 'none'}); "
                       f"{trainer} needs {wanted}")


def prepare(trainer: Any, dataset: Any, tokenizer: Any, config: Any, name: str) -> Any:
    """`trainer._prepare_dataset(dataset, tokenizer, config, name)`, its failures as one line."""
    try:
        return trainer._prepare_dataset(dataset, tokenizer, config, name)
    except (ValueError, RuntimeError, TypeError, KeyError) as exc:
        raise DatasetError(f"TRL could not prepare the {name} dataset: {first_line(exc)}") from exc


def list_lengths(prepared: Any, *columns: str) -> list[list[int]]:
    """The length of every row's list in each column, in dataset order."""
    import pyarrow.compute as pc

    # Through the arrow formatter, so the indices mapping that `filter` leaves is honoured.
    table = prepared.select_columns(list(columns)).with_format("arrow")[:]
    return [pc.list_value_length(table.column(c)).to_pylist() for c in columns]


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
    prepare_rows: Callable[[Any, Any, Any, str], tuple[R, int]],
    setup_tokenizer: Callable[[Any, Any], None] | None = None,
) -> PreparedRun[R]:
    """Load the run's data, prepare it with `prepare_rows(dataset, tokenizer, config, name) -> (rows, dropped)`, and
    replay the train and eval loops over the prepared rows."""
    config = args.training
    data = load_run_data(args, eval_source=eval_source)
    if setup_tokenizer is not None:
        setup_tokenizer(data.tokenizer, config)
    train_rows, dropped = prepare_rows(data.train, data.tokenizer, config, "train")
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
    eval_rows, _ = prepare_rows(data.eval, data.tokenizer, config, "eval")
    eval_batches, eval_steps = eval_schedule(args, loop, len(eval_rows))
    return PreparedRun(train_rows=train_rows, epoch_batches=epoch_batches, loop=loop, info=info, eval_rows=eval_rows,
                       eval_batches=eval_batches, eval_steps=eval_steps)


PRECOMPUTE_CACHED = ("ref_precompute shapes are met only when TRL finds no cached reference log-probs for this "
                     "data and model (a rerun with both unchanged skips the pass)")


def with_precompute_warning(info: RunInfo) -> RunInfo:
    return replace(info, warnings=(*info.warnings, PRECOMPUTE_CACHED))


def precompute_batches(args: TrainingArgs, run: PreparedRun[Any]) -> tuple[RankBatches, RankBatches]:
    """The train and eval batches of the reference precompute pass, or none without `precompute_ref_log_probs`."""
    config = args.training
    if not config.precompute_ref_log_probs:
        return (), ()
    size = config.precompute_ref_batch_size
    train = sequential_pass(args, len(run.train_rows), size or config.per_device_train_batch_size)
    if run.eval_rows is None:
        return train, ()
    return train, sequential_pass(args, len(run.eval_rows), size or config.per_device_eval_batch_size)
