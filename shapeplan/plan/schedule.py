"""When the Trainer runs what: micro-batches per optimizer step, epochs, and evaluation points.

A transcription of `transformers.Trainer`'s loop (`set_initial_training_values`, `_run_epoch`) and of
`DefaultFlowCallback`'s evaluation rules; the test oracle checks it against the real loop.
"""

from __future__ import annotations

import itertools
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
    # A stream's dataloader has no length: the Trainer takes an epoch as max_steps x GA micro-batches
    # (`steps_in_epoch`), but a stream shorter than that ends each pass after its micro-batches here (the last
    # length repeats for later passes). Empty: no such end.
    batches_per_pass: tuple[int, ...] = ()

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
    steps: bool = True  # the optimizer steps after this micro-batch (the step's last)


def micro_batches(loop: TrainLoop) -> Iterator[MicroBatch]:
    """Every micro-batch the training loop consumes, in order."""
    if loop.steps_in_epoch == 0:
        return
    if loop.batches_per_pass:
        yield from _stream_passes(loop)
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
            for i in range(n):
                yield MicroBatch(epoch=epoch, index=index, step=step, steps=i == n - 1)
                index += 1
            if step >= loop.total_steps:
                return


def _stream_passes(loop: TrainLoop) -> Iterator[MicroBatch]:
    """A stream read again from its start until max_steps (`_run_epoch` once per pass). The optimizer steps after
    every GA micro-batches of a pass, never at its end (a pass is shorter than steps_in_epoch): the pass's last
    batches_per_pass % GA micro-batches run no step of their own, their gradients join the next pass's first step."""
    ga = loop.gradient_accumulation_steps
    if min(loop.batches_per_pass) < ga:
        raise ValueError("a pass shorter than gradient_accumulation_steps never steps")
    step = 0  # optimizer steps run
    for epoch in itertools.count():
        for index in range(loop.batches_per_pass[min(epoch, len(loop.batches_per_pass) - 1)]):
            steps = (index + 1) % ga == 0
            yield MicroBatch(epoch=epoch, index=index, step=step + 1, steps=steps)
            if steps:
                step += 1
                if step >= loop.max_steps:
                    return


def epoch_end_steps(loop: TrainLoop) -> list[int]:
    """The global step at the end of each epoch that runs (the last one may be cut short by max_steps)."""
    return [step for step, _ in _epoch_ends(loop)]


def _epoch_ends(loop: TrainLoop) -> list[tuple[int, float]]:
    """(global step, `state.epoch`) at the end of each epoch that runs. The Trainer sets `state.epoch` to
    epoch + (micro-batches run) / steps_in_epoch at each optimizer step, so an epoch cut short ends below epoch + 1."""
    ends: dict[int, tuple[int, float]] = {}
    for mb in micro_batches(loop):
        # An epoch ends on its last optimizer step, with `state.epoch` as that step set it (a stream's pass may end
        # on leftover micro-batches, which run no step).
        if mb.steps:
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
            if (step % interval == 0 and eval_delay <= step) or (step >= total and eval_delay <= step):
                out.append(step)
    elif eval_strategy == "epoch":
        out += [step for step, epoch in _epoch_ends(loop) if eval_delay <= epoch]
    return out
