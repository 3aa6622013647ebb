"""Streaming runs of the generating trainers (`--dataset_streaming` for GRPO, RLOO and Distillation): the prompts a
run reads from an `IterableDataset`, in the run's order, read lazily.

What TRL 1.16 does with a stream (`get_train_dataloader` / `get_eval_dataloader` of `GRPOTrainer`, `RLOOTrainer`,
`DistillationTrainer`), with transformers 5.24 and accelerate 1.15:

- train: `stream.shuffle(seed=seed)` (datasets' buffered shuffle, only with `shuffle_dataset`), then TRL's own
  `repeat_iterable_dataset`, the streaming `RepeatSampler`: each generation batch of unique prompts repeated as the
  sampler repeats it, a trailing partial one dropped. The Trainer needs `max_steps`; its epoch is `max_steps x GA`
  micro-batches, and it calls `set_epoch(pass)` before each pass, so a stream shorter than that is reshuffled on
  every new pass.
- eval: `stream.shuffle(seed=seed)` always (a fresh loader per evaluation: the same order each time), then
  `repeat_iterable_dataset(mini_repeat_count=generations)`.
- `dispatch_batches=False`: accelerate gives each rank its own files (`IterableDataset.shard`) when the stream has
  enough (and split_batches is off), else `IterableDatasetShard` splits the one stream (`shapeplan.adapters.stream`).

Planning builds that same pipeline on the lazily loaded stream with one `map` between the shuffle and the repeat: it
tokenizes each prompt the shuffle yields (the trainer's own `_tokenize_prompts`) and numbers it. A `map` before the
shuffle would change how the shuffle interleaves a multi-file stream; after it, the order is the run's
(`tests/adapters/test_generation_stream.py`). Only the rows the run consumes are read (plus the shuffle's buffer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from ..errors import DatasetError, UsageError, first_line
from ..plan.schedule import TrainLoop, micro_batches
from . import stream
from .loop import check_walk, sharding
from .sampling import RankBatches, Sharding
from .trl_args import TrainingArgs

_EVAL_CHUNK = 1000  # eval prompts tokenized at a time (the eval stream is read whole)
_ID = "shapeplan_prompt"  # the column the planner's map adds: the prompt's number in the order the stream yields it


@dataclass(frozen=True)
class Repeat:
    """`repeat_iterable_dataset`'s arguments, as the trainer passes them."""

    mini_repeat_count: int
    batch_size: int = 1
    repeat_count: int = 1


@dataclass(frozen=True)
class StreamOrder:
    """The prompts a streaming run reads, numbered in the order it first reads them, and each pass's (epoch's)
    per-rank batches of those numbers."""

    lengths: tuple[int, ...]
    passes: tuple[RankBatches, ...]

    def epoch_batches(self, epoch: int) -> RankBatches:
        return self.passes[epoch]


class _Measure:
    """A batched `map` function: each prompt the stream yields, tokenized by the trainer's `_tokenize_prompts` (never
    truncated), numbered; `lengths[number]` is its token count."""

    def __init__(self, trainer: Any, name: str) -> None:
        self.trainer = trainer
        self.name = name
        self.lengths: list[int] = []

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[int]]:
        from .agentic import batch_prompts

        if "prompt" not in batch and self.trainer.environment_factories is None:
            raise DatasetError(f"the {self.name} stream has no 'prompt' column (it has {', '.join(batch)}); GRPO, "
                               "RLOO and Distillation generate from 'prompt': rename the column or pass another "
                               "dataset")
        prompts = batch_prompts(self.trainer, batch)
        try:
            ids, _, _ = self.trainer._tokenize_prompts(prompts)
        except Exception as exc:  # the tokenizer raises many types for unusable prompts
            raise DatasetError(f"cannot tokenize the {self.name} prompts: {first_line(exc)}") from exc
        first = len(self.lengths)
        self.lengths.extend(len(row) for row in ids)
        return {_ID: list(range(first, len(self.lengths)))}


def check_supported(args: TrainingArgs) -> None:
    """What TRL and the Trainer refuse with a stream, and what planning does not follow."""
    config = args.training
    if config.max_steps <= 0:
        raise UsageError("a streamed dataset has no length, so the Trainer refuses it without max_steps; pass "
                         "--max_steps N")
    accelerator = config.accelerator_config
    if accelerator.dispatch_batches:
        raise UsageError(f"TRL's {args.method} trainer refuses dispatch_batches=True on a streamed dataset (the "
                         "main process would collate the string 'prompt' column); drop dispatch_batches from "
                         "--accelerator_config")


def _pipeline(source: Any, measure: _Measure, *, shuffle: bool, seed: int, repeat: Repeat, measure_batch: int,
              sharding: Sharding) -> list[Any]:
    """The trainer's stream (shuffled, measured, repeated) as each rank reads it: one per rank when accelerate
    shards it by files, else the one shared stream. The measure tokenizes `measure_batch` prompts at a time (the
    rows the next map reads at once, so no row more is read)."""
    from trl.trainer.utils import repeat_iterable_dataset

    shuffled = source.shuffle(seed=seed) if shuffle else source
    measured = shuffled.map(measure, batched=True, batch_size=measure_batch).select_columns([_ID])
    repeated = repeat_iterable_dataset(measured, mini_repeat_count=repeat.mini_repeat_count,
                                       batch_size=repeat.batch_size, repeat_count=repeat.repeat_count)
    return stream.rank_streams(repeated, sharding)


def _read(parts: list[Any], epoch: int, limit: int | None) -> list[list[int]]:
    """Each part's prompt numbers in pass `epoch` (the Trainer's `set_epoch`), at most `limit` rows each."""
    out = []
    for part in parts:
        part.set_epoch(epoch)
        out.append([row[_ID] for row in itertools.islice(part, limit)])
    return out


def _order(numbers: list[list[int]], *, batch_size: int, option: str, sharding: Sharding) -> RankBatches:
    """Per-rank batches of prompt numbers, as the prepared DataLoader gives them."""
    flat = list(itertools.chain.from_iterable(numbers))
    positions = stream.rank_batches([len(n) for n in numbers], batch_size=batch_size, option=option,
                                    sharding=sharding)
    return [[[flat[i] for i in batch] for batch in rank] for rank in positions]


def _compact(measure: _Measure, passes: list[RankBatches]) -> StreamOrder:
    """Renumber the prompts the batches hold densely, in the order first met (the measure also numbered prompts
    the repeat read past the last batch the run takes)."""
    dense: dict[int, int] = {}
    for batches in passes:
        for rank in batches:
            for batch in rank:
                for number in batch:
                    dense.setdefault(number, len(dense))
    return StreamOrder(
        lengths=tuple(measure.lengths[number] for number in dense),
        passes=tuple([[[dense[n] for n in batch] for batch in rank] for rank in batches] for batches in passes),
    )


def train_order(args: TrainingArgs, trainer: Any, source: Any, *, repeat: Repeat, batch_size: int,
                option: str) -> tuple[StreamOrder, TrainLoop, str]:
    """The train prompts of a streaming run, each pass's batches (the dataloader's `batch_size` rows, set by
    `option`: a rank's generation batch, or the ranks' under split_batches), the Trainer's loop over them, and a
    note saying what was read."""
    config = args.training
    shards = sharding(args)
    measure = _Measure(trainer, "train")
    parts = _pipeline(source, measure, shuffle=config.shuffle_dataset, seed=config.seed, repeat=repeat,
                      measure_batch=repeat.batch_size, sharding=shards)
    micro = config.max_steps * config.gradient_accumulation_steps
    limit = micro * shards.rank_batch_size(batch_size, option) * (
        1 if len(parts) > 1 else shards.num_processes)
    first = _read(parts, 0, limit)
    if not all(first):
        raise DatasetError(f"the train stream holds fewer prompts than one generation batch "
                           f"({repeat.batch_size} unique prompts); stream more data or lower the batch")
    passes = [_order(first, batch_size=batch_size, option=option, sharding=shards)]
    # The Trainer's epoch over a stream is max_steps x GA micro-batches (`set_initial_training_values`).
    loop = TrainLoop(steps_in_epoch=micro, gradient_accumulation_steps=config.gradient_accumulation_steps,
                     num_train_epochs=config.num_train_epochs, max_steps=config.max_steps)
    if any(len(numbers) < limit for numbers in first):  # the whole stream was read: it ends before max_steps
        length = stream.pass_length(passes[0], gradient_accumulation_steps=config.gradient_accumulation_steps)
        check_walk(args, micro_batches=micro, per_pass=length)
        loop = replace(loop, batches_per_pass=(length,))
        for epoch in range(1, max(mb.epoch for mb in micro_batches(loop)) + 1):
            passes.append(_order(_read(parts, epoch, None), batch_size=batch_size, option=option, sharding=shards))
            if {len(rank) for rank in passes[-1]} != {length}:
                raise UsageError("the ranks' shards of the stream change length between passes (the files are "
                                 "dealt anew each pass), so the ranks would fall out of step; lower --max_steps to "
                                 "what one pass holds")
    order = _compact(measure, passes)
    again = ("" if len(passes) == 1 else
             f", the whole stream {len(passes)} times{' (reshuffled each pass)' if config.shuffle_dataset else ''}")
    note = (f"streaming: the run reads {len(order.lengths)} train prompts{again}, each repeated as TRL's "
            f"repeat_iterable_dataset repeats it; planning read only those"
            f"{' and the shuffle buffer' if config.shuffle_dataset else ''}")
    return order, loop, note


def eval_order(args: TrainingArgs, trainer: Any, source: Any, generations: int) -> StreamOrder:
    """The eval prompts and the per-rank batches of one evaluation: every evaluation reads the whole eval stream in
    the same shuffled order."""
    config = args.training
    measure = _Measure(trainer, "eval")
    parts = _pipeline(source, measure, shuffle=True, seed=config.seed, repeat=Repeat(generations),
                      measure_batch=_EVAL_CHUNK, sharding=sharding(args))
    batches = _order(_read(parts, 0, None), batch_size=config.per_device_eval_batch_size,
                     option="per_device_eval_batch_size", sharding=sharding(args))
    return _compact(measure, [batches])


def is_stream(dataset: Any) -> bool:
    import datasets

    return isinstance(dataset, datasets.IterableDataset)

