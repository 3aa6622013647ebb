"""The batch order the Trainer's dataloaders produce, replayed with torch's, transformers' and accelerate's own
samplers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..plan.batches import RankBatches
from ..plan.rows import Dispatched

# The train_sampling_strategy values `train_batches` draws orders for.
TRAIN_STRATEGIES = ("random", "sequential", "group_by_length", "batch_rebalance")


@dataclass(frozen=True, slots=True)
class Sharding:
    """How accelerate's `prepare_data_loader` deals a dataloader's batches to the ranks: the launch's process count
    and `--accelerator_config`'s dataloader options, as the Trainer passes them to its `Accelerator`."""

    num_processes: int = 1
    split_batches: bool = False  # each batch is cut into num_processes slices, one per rank
    even_batches: bool = True  # the last round is completed with the first rows, so every rank gets a full batch
    dispatch_batches: bool = False  # rank 0 loads and collates, then slices the batch for every rank
    halves: bool = False  # the collator stacks every example's chosen sequence, then every rejected one

    @property
    def split(self) -> bool:
        return self.split_batches and self.num_processes > 1

    def rank_batch_size(self, batch_size: int, option: str) -> int:
        """The rows each rank's batch holds when the dataloader's batch is `batch_size` (set by `option`).
        accelerate refuses split_batches on a batch size that is not a multiple of the ranks (a batch of 1 it
        splits into empty slices)."""
        if not self.split:
            return batch_size
        if batch_size % self.num_processes:
            raise UsageError(f"split_batches cuts each batch of {option}={batch_size} into {self.num_processes} "
                             "equal slices, which accelerate refuses (or, for a batch of 1, leaves empty); set "
                             f"{option} to a multiple of --num_processes or drop split_batches")
        return batch_size // self.num_processes


def _batches(order: Sequence[int], batch_size: int, drop_last: bool, sharding: Sharding) -> RankBatches:
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    batch_sampler = BatchSampler(list(order), batch_size, drop_last)
    _check_ranks(sharding.num_processes, len(batch_sampler))
    if sharding.num_processes == 1:
        return [[list(b) for b in batch_sampler]]
    if sharding.dispatch_batches:
        return _dispatched([list(b) for b in batch_sampler], sharding, drop_last)
    ranks = [
        [list(b) for b in BatchSamplerShard(batch_sampler, sharding.num_processes, rank,
                                           split_batches=sharding.split_batches, even_batches=sharding.even_batches)]
        for rank in range(sharding.num_processes)
    ]
    counts = sorted({len(batches) for batches in ranks})
    if len(counts) > 1:  # only even_batches=False leaves ranks unequal
        raise UsageError(f"with even_batches=false the ranks get {' and '.join(map(str, counts))} batches of "
                         f"{len(order)} rows, so the Trainer's ranks fall out of step (one runs a forward and its "
                         "collectives alone); drop even_batches=false or use a row count whose batches divide by "
                         "--num_processes")
    return ranks


# accelerate deals each rank its batches by walking the whole dataloader, and completes a short last round from its
# first batches: ranks x (batches + ranks) steps, which more ranks than batches turn quadratic in the ranks.
MAX_DEAL = 1_000_000


def _check_ranks(ranks: int, batches: int) -> None:
    if ranks > batches and ranks * (batches + ranks) > MAX_DEAL:
        raise UsageError(f"--num_processes {ranks} is more ranks than the {batches} batch(es) the data makes: most "
                         "ranks would train on copies of the first rows, and dealing them is too slow to replay; "
                         "pass the run's real process count")


def _dispatched(batches: list[list[int]], sharding: Sharding, drop_last: bool) -> RankBatches:
    """What accelerate's `DataLoaderDispatcher` hands each rank: rank 0 loads and collates, then slices by rows.

    Without split_batches rank 0 collates `num_processes` batches one by one and concatenates them (a last group
    may hold fewer; drop_last drops it); with split_batches it collates one batch. Rank r takes the r-th of
    `num_processes` equal row slices; a last batch whose rows do not divide is completed with the first
    `num_processes` rows of the first one (as rank 0 collated them) and each slice gets one row more.

    A collator that stacks `halves` (chosen, then rejected) makes a slice straddle them unless each slice is one
    whole collated batch: rank 0 then hands a rank chosen sequences without their rejected ones."""
    ranks = sharding.num_processes
    if sharding.split_batches:
        groups = [[batch] for batch in batches]
    else:
        groups = [batches[i:i + ranks] for i in range(0, len(batches), ranks)]
        if drop_last and groups and len(groups[-1]) < ranks:
            groups.pop()
    if sharding.halves:
        _check_whole_halves(groups, ranks, split=sharding.split_batches)
    out: list[list[Dispatched]] = [[] for _ in range(ranks)]
    for number, parts in enumerate(groups):
        rows = [i for part in parts for i in part]
        size = len(rows) // ranks
        if number == len(groups) - 1 and not drop_last and len(rows) % ranks:
            first = groups[0]
            rows += [i for part in first for i in part][:ranks]
            parts = [*parts, *first]  # the appended rows keep the first batch's padding
            size += 1
        collated = tuple(tuple(part) for part in parts)
        for rank in range(ranks):
            out[rank].append(Dispatched(tuple(rows[rank * size:(rank + 1) * size]), collated))
    return out


def _check_whole_halves(groups: list[list[list[int]]], ranks: int, *, split: bool) -> None:
    if split:
        raise UsageError("dispatch_batches=true with split_batches: rank 0 collates each batch as every chosen "
                         "sequence then every rejected one and cuts it into equal row slices, so one rank trains on "
                         "chosen sequences only and another on rejected ones as if they were pairs; drop "
                         "split_batches or dispatch_batches")
    for parts in groups:
        if len(parts) < ranks or len({len(part) for part in parts}) > 1:
            raise UsageError(f"dispatch_batches=true: rank 0 concatenates the last {len(parts)} batch(es) of "
                             f"{' and '.join(str(len(part)) for part in parts)} pairs, each collated as chosen "
                             f"then rejected sequences, and cuts them into {ranks} equal row slices, which split "
                             "pairs across ranks (one trains on chosen sequences without their rejected ones); use a "
                             "row count that is a multiple of the batch size x --num_processes, set "
                             "--dataloader_drop_last, or drop dispatch_batches")


def _length_grouped(lengths: Sequence[int], batch_size: int, seed: int) -> list[int]:
    """`LengthGroupedSampler`'s order with a generator seeded with `seed`."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    return list(LengthGroupedSampler(batch_size, lengths=list(lengths), generator=torch.Generator().manual_seed(seed)))


def train_batches(
    num_rows: int,
    *,
    batch_size: int,
    sharding: Sharding,
    strategy: str,
    seed: int,
    data_seed: int | None,
    drop_last: bool,
    lengths: Sequence[int] = (),
    gradient_accumulation_steps: int = 1,
) -> Callable[[int], RankBatches]:
    """epoch -> per-rank batches of row indices, as `Trainer.get_train_dataloader` + `accelerator.prepare` give.

    "random": accelerate swaps the `RandomSampler` for a `SeedableRandomSampler` seeded with `data_seed`
    (or the `seed` TRL passed to `set_seed`) plus the epoch.
    "group_by_length": `LengthGroupedSampler(batch_size * gradient_accumulation_steps)` over the rows' `lengths`.
    The Trainer gives it no generator, so the run draws from the global RNG; this is one order it can draw
    (seeded with `seed` plus the epoch), which only fixes batch sizes and token counts, never the run's order.
    "batch_rebalance": one `BatchRebalanceSampler` per rank (it shards itself; the Trainer makes accelerate's
    shard a pass-through), with the Trainer's arguments and its own fixed seed.
    """
    if strategy == "batch_rebalance":
        return _rebalanced(lengths, batch_size=batch_size, sharding=sharding,
                          gradient_accumulation_steps=gradient_accumulation_steps, drop_last=drop_last)
    if strategy == "random":
        from accelerate.data_loader import SeedableRandomSampler

        sampler = SeedableRandomSampler(range(num_rows), data_seed=data_seed if data_seed is not None else seed)

        def order(epoch: int) -> list[int]:
            sampler.set_epoch(epoch)
            return list(sampler)
    elif strategy == "sequential":
        def order(epoch: int) -> list[int]:
            return list(range(num_rows))
    elif strategy == "group_by_length":
        def order(epoch: int) -> list[int]:
            return _length_grouped(lengths, batch_size * gradient_accumulation_steps, seed + epoch)
    else:
        raise ValueError(f"no order for train_sampling_strategy={strategy!r}")

    return lambda epoch: _batches(order(epoch), batch_size, drop_last, sharding)


def _rebalanced(lengths: Sequence[int], *, batch_size: int, sharding: Sharding, gradient_accumulation_steps: int,
                drop_last: bool) -> Callable[[int], RankBatches]:
    """One `BatchRebalanceSampler` per rank. Under dispatch_batches only rank 0's dataloader is read: rank 0
    dispatches its own sampler's batches to every rank (the other ranks' shares of the data are never read)."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    ranks = sharding.num_processes
    samplers = [
        BatchRebalanceSampler(lengths=list(lengths), effective_batch_size=batch_size * gradient_accumulation_steps
                              * ranks, dp_size=ranks, grad_accum=gradient_accumulation_steps,
                              rank=rank, drop_last=drop_last)
        for rank in range(1 if sharding.dispatch_batches else ranks)
    ]

    def epoch_batches(epoch: int) -> RankBatches:
        for sampler in samplers:
            sampler.set_epoch(epoch)
        batches = [[list(batch) for batch in sampler] for sampler in samplers]
        return _dispatched(batches[0], sharding, drop_last) if sharding.dispatch_batches else batches

    return epoch_batches


def eval_batches(num_rows: int, *, batch_size: int, sharding: Sharding, drop_last: bool,
                 grouped_lengths: Sequence[int] | None = None, seed: int = 0) -> RankBatches:
    """The eval loop's order, sharded across ranks with even batches: sequential, or with
    train_sampling_strategy "group_by_length" (pass the rows' lengths as `grouped_lengths`) `LengthGroupedSampler`
    seeded with `seed` (`data_seed`, else `seed`), a fresh generator at every evaluation."""
    order = range(num_rows) if grouped_lengths is None else _length_grouped(grouped_lengths, batch_size, seed)
    return _batches(order, batch_size, drop_last, sharding)


def ordered_batches(order: Sequence[int], *, batch_size: int, sharding: Sharding, drop_last: bool) -> RankBatches:
    """Per-rank batches of a custom sampler's `order` (e.g. TRL's `RepeatSampler`), as the prepared DataLoader
    gives them: accelerate shards whole batches across ranks, since such a sampler is not a `RandomSampler`."""
    return _batches(order, batch_size, drop_last, sharding)
