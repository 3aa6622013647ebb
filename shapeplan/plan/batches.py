"""Trainers fed by the Trainer's dataloaders: a trainer is a function from a batch of row indices to the forwards
the model runs on it. This module walks the train loop and the other passes over the data, and counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .counter import ShapeCounter
from .model import Method, Phase, Plan, PlanStats
from .rows import BatchShape
from .schedule import TrainLoop, micro_batches

# rank -> batches -> row indices, for one epoch (train) or one pass (eval, precompute)
RankBatches = Sequence[Sequence[Sequence[int]]]
# row indices of one batch -> the (phase, shape) of every forward the trainer runs on it
Forwards = Callable[[Sequence[int]], Sequence[tuple[Phase, BatchShape]]]


@dataclass(frozen=True, slots=True)
class Pass:
    """A walk over a dataset outside the train loop, in the same order each time it runs: the eval loop (after each
    evaluation step) or a reference precompute pass (once, before training: step 0)."""

    batches: RankBatches
    steps: Sequence[int]
    forwards: Forwards


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What a plan records besides its shapes."""

    method: Method
    rows: int  # rows of the prepared train dataset
    pad_to_multiple_of: int | None
    dropped_rows: int = 0
    exact: bool = True
    config: dict[str, object] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    fingerprint: dict[str, str] = field(default_factory=dict)
    warnings: Sequence[str] = ()


def plan_batches(
    *,
    loop: TrainLoop,
    epoch_batches: Callable[[int], RankBatches],
    train_forwards: Forwards,
    passes: Sequence[Pass],
    info: RunInfo,
) -> Plan:
    """Every forward of every micro-batch of every rank, then of every pass; token stats count the `train` phase,
    the eval stats the pass that runs `eval` forwards (the eval loop)."""
    counter = ShapeCounter()
    current_epoch, batches = -1, None
    micro = tokens = padded = last_step = 0
    for mb in micro_batches(loop):
        if mb.epoch != current_epoch:
            current_epoch, batches = mb.epoch, epoch_batches(mb.epoch)
        assert batches is not None
        for rank_batches in batches:
            if mb.index >= len(rank_batches):
                continue
            micro += 1
            for phase, shape in train_forwards(rank_batches[mb.index]):
                _add(counter, phase, shape, mb.step, 1)
                if phase == "train":
                    tokens += shape.tokens
                    padded += shape.batch * shape.seq
        last_step = mb.step
    evaluations = eval_rows = 0
    for p in passes:
        if not p.steps:
            continue
        rows: set[int] = set()
        evaluates = False
        for rank_batches in p.batches:
            for batch in rank_batches:
                rows.update(batch)
                for phase, shape in p.forwards(batch):
                    _add(counter, phase, shape, p.steps[0], len(p.steps))
                    evaluates = evaluates or phase == "eval"
        if evaluates:
            evaluations, eval_rows = len(p.steps), len(rows)
    return Plan(
        method=info.method,
        exact=info.exact,
        pad_to_multiple_of=info.pad_to_multiple_of,
        shapes=counter.shapes(),
        stats=PlanStats(rows=info.rows, dropped_rows=info.dropped_rows, micro_batches=micro,
                        optimizer_steps=last_step, tokens=tokens, padded_tokens=padded,
                        evaluations=evaluations, eval_rows=eval_rows),
        config=dict(info.config),
        versions=dict(info.versions),
        fingerprint=dict(info.fingerprint),
        warnings=tuple(info.warnings),
    )


def _add(counter: ShapeCounter, phase: Phase, shape: BatchShape, step: int, count: int) -> None:
    counter.add(phase, shape.batch, shape.seq, step, count=count,
                cu_seq_lens=shape.cu_seq_lens, max_length_q=shape.max_length_q,
                completion_tokens=shape.completion_tokens, chosen_rows=shape.chosen_rows, unpadded=shape.unpadded,
                vision=shape.vision, text_runs=shape.text_runs)
