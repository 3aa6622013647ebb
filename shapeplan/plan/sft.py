"""SFT: the shapes `SFTTrainer` feeds the model, from prepared row lengths and the batch order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .counter import ShapeCounter
from .model import Plan, PlanStats
from .rows import BatchShape, Rows, padded_batch, padding_free_batch, reachable_seqs
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

    def reachable(self, rows: Rows, size: int) -> tuple[tuple[int, int], ...]:
        """Every (batch, seq) a batch of `size` rows can have in some order."""
        seqs = reachable_seqs(rows, size, self.pad_to_multiple_of, padding_free=self.padding_free)
        return tuple((1 if self.padding_free else size, seq) for seq in seqs)


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
    """The SFT plan. `exact=False`: `epoch_batches` is one order the sampler can draw, not the run's; the train
    shapes are then the bound of `bound_train` and the token counts those of that order."""
    counter = ShapeCounter()
    if exact:
        stats = count_train(counter, train_rows, train_layout, loop, epoch_batches)
    else:
        # Token accounting of the order `epoch_batches` draws; the shapes are the bound over every order.
        stats = count_train(ShapeCounter(), train_rows, train_layout, loop, epoch_batches)
        bound_train(counter, train_rows, train_layout, loop, epoch_batches)
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
