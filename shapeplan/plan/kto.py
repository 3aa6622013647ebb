"""KTO: each batch runs the policy on the KL sequences (prompts with completions rotated within the batch, no grad)
and on the rows themselves (train), then the reference model on both, in the step or in a precompute pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .batches import Forwards, Pass, RankBatches, RunInfo, plan_batches
from .model import Phase, Plan
from .preference import completion_tokens, padded_rows
from .rows import BatchShape
from .schedule import TrainLoop


@dataclass(frozen=True, slots=True)
class UnpairedRows:
    """Token lengths of prepared KTO rows, in dataset order, before truncation: prompt + completion, and prompt + the
    row's KL completion (None when the loss has no KL term)."""

    lengths: tuple[int, ...]
    kl_lengths: tuple[int, ...] | None
    prompt: tuple[int, ...] = ()  # the prompt's share of `lengths`
    labels: tuple[bool, ...] = ()  # desirable or not

    def __len__(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True, slots=True)
class KTOLayout:
    max_length: int | None  # the collator cuts every sequence to it
    precompute_ref: bool  # the reference log-probs come from a pass before training, not from the step


def _completion_counts(rows: UnpairedRows, batch: Sequence[int], max_length: int | None) -> tuple[int, int]:
    """Completion tokens of the batch's desirable rows and of its undesirable rows (the collator keeps the start)."""
    counts = [completion_tokens(rows.prompt[i], rows.lengths[i], max_length, "keep_start") for i in batch]
    return (sum(n for n, i in zip(counts, batch, strict=True) if rows.labels[i]),
            sum(n for n, i in zip(counts, batch, strict=True) if not rows.labels[i]))


def plan_kto(
    *,
    train_rows: UnpairedRows,
    layout: KTOLayout,
    loop: TrainLoop,
    epoch_batches: Callable[[int], RankBatches],
    info: RunInfo,
    eval_rows: UnpairedRows | None = None,
    eval_batches: RankBatches = (),
    eval_steps: Sequence[int] = (),
    precompute_batches: RankBatches = (),
    eval_precompute_batches: RankBatches = (),
) -> Plan:
    def forwards(rows: UnpairedRows, *, main: tuple[Phase, ...], kl: tuple[Phase, ...]) -> Forwards:
        def run(batch: Sequence[int]) -> list[tuple[Phase, BatchShape]]:
            shape = padded_rows(batch, lambda i: (rows.lengths[i],), info.pad_to_multiple_of, layout.max_length)
            # the policy's step selects the desirable rows and the completion tokens of each kind for its loss and
            # metrics; the reference forwards do not
            policy = replace(shape, completion_tokens=_completion_counts(rows, batch, layout.max_length),
                             chosen_rows=sum(rows.labels[i] for i in batch))
            out = [(phase, policy if phase in ("train", "eval") else shape) for phase in main]
            if rows.kl_lengths is not None:
                kl_lengths = rows.kl_lengths
                kl_shape = padded_rows(batch, lambda i: (kl_lengths[i],), info.pad_to_multiple_of,
                                       layout.max_length)
                out += [(phase, kl_shape) for phase in kl]
            return out
        return run

    ref = not layout.precompute_ref
    train = forwards(train_rows, main=("train", "ref") if ref else ("train",), kl=("kl", "ref_kl") if ref else ("kl",))
    passes = []
    if layout.precompute_ref:
        passes.append(Pass(precompute_batches, (0,), forwards(train_rows, main=("ref_precompute",),
                                                              kl=("ref_precompute",))))
    if eval_rows is not None:
        passes.append(Pass(eval_batches, tuple(eval_steps),
                           forwards(eval_rows, main=("eval", "eval_ref") if ref else ("eval",),
                                    kl=("eval_kl", "eval_ref_kl") if ref else ("eval_kl",))))
        if layout.precompute_ref:
            passes.append(Pass(eval_precompute_batches, (0,), forwards(eval_rows, main=("ref_precompute",),
                                                                       kl=("ref_precompute",))))
    return plan_batches(loop=loop, epoch_batches=epoch_batches, train_forwards=train, passes=passes, info=info)
