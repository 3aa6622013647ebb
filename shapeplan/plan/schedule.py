"""When the Trainer runs what: micro-batches per optimizer step, epochs, and evaluation points.

A transcription of `transformers.Trainer`'s loop (`set_initial_training_values`, `_run_epoch`) and of
`DefaultFlowCallback`'s evaluation rules; the test oracle checks it against the real loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TrainLoop:
    """The loop settings that decide how many micro-batches run, as `TrainingArguments` names them."""

    steps_in_epoch: int  # micro-batches per epoch and rank: len(train dataloader)
    gradient_accumulation_steps: int
    num_train_epochs: float
    max_steps: int  # <= 0: derive from num_train_epochs

    @property
    def updates_per_epoch(self) -> int:
        return max(math.ceil(self.steps_in_epoch / self.gradient_accumulation_steps), 1)

    @property
    def total_steps(self) -> int:
        if self.max_steps > 0:
            return self.max_steps
        return math.ceil(self.num_train_epochs * self.updates_per_epoch)

    @property
    def epochs(self) -> int:
        if self.max_steps > 0:
            return math.ceil(self.max_steps / self.updates_per_epoch)
        return math.ceil(self.num_train_epochs)


@dataclass(frozen=True, slots=True)
class MicroBatch:
    epoch: int
    index: int  # position of the batch in the epoch's dataloader order
    step: int  # 1-based optimizer step this micro-batch belongs to


def micro_batches(loop: TrainLoop) -> Iterator[MicroBatch]:
    """Every micro-batch the training loop consumes, in order."""
    if loop.steps_in_epoch == 0:
        return
    ga = loop.gradient_accumulation_steps
    remainder = loop.steps_in_epoch % ga or ga
    step = 0
    for epoch in range(loop.epochs):
        index = 0
        for update in range(loop.updates_per_epoch):
            n = ga if update != loop.updates_per_epoch - 1 else remainder
            n = min(n, loop.steps_in_epoch - index)
            step += 1
            for _ in range(n):
                yield MicroBatch(epoch=epoch, index=index, step=step)
                index += 1
            if step >= loop.total_steps:
                return


def epoch_end_steps(loop: TrainLoop) -> list[int]:
    """The global step at the end of each epoch that runs (the last one may be cut short by max_steps)."""
    return [step for step, _ in _epoch_ends(loop)]


def _epoch_ends(loop: TrainLoop) -> list[tuple[int, float]]:
    """(global step, `state.epoch`) at the end of each epoch that runs. The Trainer sets `state.epoch` to
    epoch + (micro-batches run) / steps_in_epoch at each optimizer step, so an epoch cut short ends below epoch + 1."""
    ends: dict[int, tuple[int, float]] = {}
    for mb in micro_batches(loop):
        ends[mb.epoch] = (mb.step, mb.epoch + (mb.index + 1) / loop.steps_in_epoch)
    return [ends[e] for e in sorted(ends)]


def evaluation_steps(
    loop: TrainLoop,
    *,
    eval_strategy: str,
    eval_steps: float | None,
    eval_delay: float,
    eval_on_start: bool,
) -> list[int]:
    """The global steps after which the eval loop runs (0 = `eval_on_start`), in order, repeats kept."""
    total = loop.total_steps
    out: list[int] = [0] if eval_on_start else []
    if eval_strategy == "steps":
        every = eval_steps if eval_steps is not None else 500
        interval = math.ceil(total * every) if every < 1 else int(every)
        last = epoch_end_steps(loop)[-1] if loop.steps_in_epoch else 0
        for step in range(1, last + 1):
            if step % interval == 0 and eval_delay <= step:
                out.append(step)
            elif step >= total and eval_delay <= step:
                out.append(step)
    elif eval_strategy == "epoch":
        out += [step for step, epoch in _epoch_ends(loop) if eval_delay <= epoch]
    return out
