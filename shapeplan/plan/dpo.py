"""DPO: each batch is chosen and rejected stacked (2B, T); the policy trains on it and the reference model reads
it, in the train step or, with precompute_ref_log_probs, in one pass over the data before training."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .batches import Forwards, Pass, RankBatches, RunInfo, plan_batches
from .model import Phase, Plan
from .preference import PairedRows, completion_tokens, stacked_batch
from .rows import BatchShape
from .schedule import TrainLoop


@dataclass(frozen=True, slots=True)
class DPOLayout:
    max_length: int | None  # the collator cuts every sequence to it
    precompute_ref: bool  # the reference log-probs come from a pass before training, not from the step
    truncation_mode: str = "keep_start"  # which end of a sequence the cut keeps


def _completion_counts(rows: PairedRows, batch: Sequence[int], layout: DPOLayout) -> tuple[int, int]:
    def count(totals: tuple[int, ...]) -> int:
        return sum(completion_tokens(rows.prompt[i], totals[i], layout.max_length, layout.truncation_mode)
                   for i in batch)
    return count(rows.chosen), count(rows.rejected)


def plan_dpo(
    *,
    train_rows: PairedRows,
    layout: DPOLayout,
    loop: TrainLoop,
    epoch_batches: Callable[[int], RankBatches],
    info: RunInfo,
    eval_rows: PairedRows | None = None,
    eval_batches: RankBatches = (),
    eval_steps: Sequence[int] = (),
    precompute_batches: RankBatches = (),
    eval_precompute_batches: RankBatches = (),
) -> Plan:
    def forwards(rows: PairedRows, phases: tuple[Phase, ...]) -> Forwards:
        def run(batch: Sequence[int]) -> list[tuple[Phase, BatchShape]]:
            shape = stacked_batch(rows, batch, info.pad_to_multiple_of, layout.max_length)
            # the policy's step computes the metrics that select completion tokens; the reference forwards do not
            policy = replace(shape, completion_tokens=_completion_counts(rows, batch, layout))
            return [(phase, policy if phase in ("train", "eval") else shape) for phase in phases]
        return run

    train_phases: tuple[Phase, ...] = ("train",) if layout.precompute_ref else ("train", "ref")
    passes = []
    if layout.precompute_ref:
        passes.append(Pass(precompute_batches, (0,), forwards(train_rows, ("ref_precompute",))))
    if eval_rows is not None:
        eval_phases: tuple[Phase, ...] = ("eval",) if layout.precompute_ref else ("eval", "eval_ref")
        passes.append(Pass(eval_batches, tuple(eval_steps), forwards(eval_rows, eval_phases)))
        if layout.precompute_ref:
            passes.append(Pass(eval_precompute_batches, (0,), forwards(eval_rows, ("ref_precompute",))))
    return plan_batches(loop=loop, epoch_batches=epoch_batches,
                        train_forwards=forwards(train_rows, train_phases), passes=passes, info=info)
