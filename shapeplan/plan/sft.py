"""SFT: the shapes `SFTTrainer` feeds the model, from prepared row lengths and the batch order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .batches import Forwards, Pass, RankBatches, RunInfo, plan_batches
from .counter import ShapeCounter, shape_sort_key
from .model import Phase, Plan
from .rows import BatchShape, Rows, padded_batch, padding_free_batch, reachable_seqs
from .schedule import TrainLoop, micro_batches


@dataclass(frozen=True, slots=True)
class SFTLayout:
    """How SFT collates: padded (B, R(max)) or padding-free (1, R(sum)), with the padding multiple."""

    pad_to_multiple_of: int | None
    padding_free: bool

    def shape(self, rows: Rows, batch: Sequence[int]) -> BatchShape:
        collate = padding_free_batch if self.padding_free else padded_batch
        return collate(rows, batch, self.pad_to_multiple_of)

    def reachable(self, rows: Rows, size: int) -> tuple[tuple[int, int], ...]:
        """Every (batch, seq) a batch of `size` rows can have in some order."""
        seqs = reachable_seqs(rows, size, self.pad_to_multiple_of, padding_free=self.padding_free)
        return tuple((1 if self.padding_free else size, seq) for seq in seqs)

    def forwards(self, rows: Rows, phase: Phase) -> Forwards:
        """SFT runs one forward per batch: the model on the collated batch."""
        return lambda batch: [(phase, self.shape(rows, batch))]


def bound_train(
    counter: ShapeCounter,
    rows: Rows,
    layout: SFTLayout,
    loop: TrainLoop,
    epoch_batches: Callable[[int], RankBatches],
) -> None:
    """Adds every train shape some order of the rows can produce, for an order that cannot be replayed.

    Batch sizes do not depend on the order, so each shape a batch of size b can take gets the number of
    micro-batches of size b (the most it can have) and the first step that runs one (the earliest it can appear).
    `epoch_batches` is any order the sampler can draw; only its batch sizes are read.
    """
    per_size: dict[int, list[int]] = {}  # batch size -> [micro-batches, first step]
    current_epoch, sizes = -1, []
    for mb in micro_batches(loop):
        if mb.epoch != current_epoch:
            current_epoch = mb.epoch
            sizes = [[len(batch) for batch in rank_batches] for rank_batches in epoch_batches(mb.epoch)]
        for rank_sizes in sizes:
            if mb.index < len(rank_sizes):
                entry = per_size.setdefault(rank_sizes[mb.index], [0, mb.step])
                entry[0] += 1
    for size, (count, first_step) in sorted(per_size.items()):
        for batch, seq in layout.reachable(rows, size):
            counter.add("train", batch, seq, first_step, count=count, certain=False)


def plan_sft(
    *,
    train_rows: Rows,
    layout: SFTLayout,
    loop: TrainLoop,
    epoch_batches: Callable[[int], RankBatches],
    info: RunInfo,
    eval_rows: Rows | None = None,
    eval_batches: RankBatches = (),
    eval_steps: Sequence[int] = (),
) -> Plan:
    """The SFT plan. `info.exact=False`: `epoch_batches` is one order the sampler can draw, not the run's; the train
    shapes are then the bound of `bound_train` and the token counts those of that order."""
    passes = [] if eval_rows is None else [Pass(eval_batches, tuple(eval_steps), layout.forwards(eval_rows, "eval"))]
    plan = plan_batches(loop=loop, epoch_batches=epoch_batches,
                        train_forwards=layout.forwards(train_rows, "train"), passes=passes, info=info)
    if info.exact:
        return plan
    bound = ShapeCounter()
    bound_train(bound, train_rows, layout, loop, epoch_batches)
    shapes = (*bound.shapes(), *(s for s in plan.shapes if s.phase != "train"))
    return replace(plan, shapes=tuple(sorted(shapes, key=shape_sort_key)))
