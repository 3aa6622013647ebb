"""SFT: the shapes `SFTTrainer` feeds the model, from prepared row lengths and the batch order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .counter import ShapeCounter
from .model import Plan, PlanStats
from .rows import BatchShape, Rows, padded_batch, padding_free_batch
from .schedule import TrainLoop, micro_batches

# rank -> batches -> row indices, for one epoch (train) or one pass (eval)
RankBatches = Sequence[Sequence[Sequence[int]]]


@dataclass(frozen=True, slots=True)
class SFTLayout:
    """How SFT collates: padded (B, R(max)) or padding-free (1, R(sum)), with the padding multiple."""

    pad_to_multiple_of: int | None
    padding_free: bool

    def shape(self, rows: Rows, batch: Sequence[int]) -> BatchShape:
        collate = padding_free_batch if self.padding_free else padded_batch
        return collate(rows, batch, self.pad_to_multiple_of)


def count_train(
    counter: ShapeCounter,
    rows: Rows,
    layout: SFTLayout,
    loop: TrainLoop,
    epoch_batches: Callable[[int], RankBatches],
) -> PlanStats:
    """Adds every train micro-batch of every rank to `counter`; returns the train token accounting."""
    current_epoch, batches = -1, None
    micro = tokens = padded = 0
    last_step = 0
    for mb in micro_batches(loop):
        if mb.epoch != current_epoch:
            current_epoch, batches = mb.epoch, epoch_batches(mb.epoch)
        assert batches is not None
        for rank_batches in batches:
            if mb.index >= len(rank_batches):
                continue
            shape = layout.shape(rows, rank_batches[mb.index])
            counter.add("train", shape.batch, shape.seq, mb.step,
                        cu_seq_lens=shape.cu_seq_lens, max_length_q=shape.max_length_q)
            micro += 1
            tokens += shape.tokens
            padded += shape.batch * shape.seq
        last_step = mb.step
    return PlanStats(rows=len(rows), dropped_rows=0, micro_batches=micro, optimizer_steps=last_step,
                     tokens=tokens, padded_tokens=padded)


def count_eval(
    counter: ShapeCounter,
    rows: Rows,
    layout: SFTLayout,
    batches: RankBatches,
    eval_steps: Sequence[int],
    phase: str = "eval",
) -> None:
    """Adds one full eval pass per entry of `eval_steps` (the eval loop always walks the same order)."""
    if not eval_steps:
        return
    for rank_batches in batches:
        for batch in rank_batches:
            shape = layout.shape(rows, batch)
            counter.add(phase, shape.batch, shape.seq, eval_steps[0], count=len(eval_steps),
                        cu_seq_lens=shape.cu_seq_lens, max_length_q=shape.max_length_q)


def plan_sft(
    *,
    train_rows: Rows,
    train_layout: SFTLayout,
    loop: TrainLoop,
    epoch_batches: Callable[[int], RankBatches],
    eval_rows: Rows | None = None,
    eval_layout: SFTLayout | None = None,
    eval_batches: RankBatches = (),
    eval_steps: Sequence[int] = (),
    dropped_rows: int = 0,
    exact: bool = True,
    config: dict[str, object] | None = None,
    versions: dict[str, str] | None = None,
    fingerprint: dict[str, str] | None = None,
    warnings: Sequence[str] = (),
) -> Plan:
    counter = ShapeCounter()
    stats = count_train(counter, train_rows, train_layout, loop, epoch_batches)
    if eval_rows is not None:
        count_eval(counter, eval_rows, eval_layout or train_layout, eval_batches, eval_steps)
    return Plan(
        method="sft",
        exact=exact,
        pad_to_multiple_of=train_layout.pad_to_multiple_of,
        shapes=counter.shapes(),
        stats=PlanStats(rows=stats.rows, dropped_rows=dropped_rows, micro_batches=stats.micro_batches,
                        optimizer_steps=stats.optimizer_steps, tokens=stats.tokens, padded_tokens=stats.padded_tokens),
        config=dict(config or {}),
        versions=dict(versions or {}),
        fingerprint=dict(fingerprint or {}),
        warnings=tuple(warnings),
    )
