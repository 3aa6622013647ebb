"""Reward: each batch is chosen and rejected stacked (2B, T) through the sequence classifier. Preparation drops
rows longer than max_length instead of truncating them, so the collator never cuts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .batches import Pass, RankBatches, RunInfo, plan_batches
from .model import Plan
from .preference import PairedRows, stacked_batch
from .schedule import TrainLoop


def plan_reward(
    *,
    train_rows: PairedRows,
    loop: TrainLoop,
    epoch_batches: Callable[[int], RankBatches],
    info: RunInfo,
    eval_rows: PairedRows | None = None,
    eval_batches: RankBatches = (),
    eval_steps: Sequence[int] = (),
) -> Plan:
    multiple = info.pad_to_multiple_of
    passes = []
    if eval_rows is not None:
        passes.append(Pass(eval_batches, tuple(eval_steps),
                           lambda batch: [("eval", stacked_batch(eval_rows, batch, multiple))]))
    return plan_batches(loop=loop, epoch_batches=epoch_batches,
                        train_forwards=lambda batch: [("train", stacked_batch(train_rows, batch, multiple))],
                        passes=passes, info=info)
