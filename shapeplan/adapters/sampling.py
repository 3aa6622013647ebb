"""The batch order the Trainer's dataloaders produce, replayed with torch's and accelerate's own samplers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

RankBatches = list[list[list[int]]]


def _batches(order: Sequence[int], batch_size: int, drop_last: bool, num_processes: int) -> RankBatches:
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    batch_sampler = BatchSampler(list(order), batch_size, drop_last)
    if num_processes == 1:
        return [[list(b) for b in batch_sampler]]
    return [
        [list(b) for b in BatchSamplerShard(batch_sampler, num_processes, rank, split_batches=False,
                                           even_batches=True)]
        for rank in range(num_processes)
    ]


def train_batches(
    num_rows: int,
    *,
    batch_size: int,
    num_processes: int,
    strategy: str,
    seed: int,
    data_seed: int | None,
    drop_last: bool,
) -> Callable[[int], RankBatches]:
    """epoch -> per-rank batches of row indices, as `Trainer.get_train_dataloader` + `accelerator.prepare` give.

    "random": accelerate swaps the `RandomSampler` for a `SeedableRandomSampler` seeded with `data_seed`
    (or the `seed` TRL passed to `set_seed`) plus the epoch.
    """
    if strategy == "random":
        from accelerate.data_loader import SeedableRandomSampler

        sampler = SeedableRandomSampler(range(num_rows), data_seed=data_seed if data_seed is not None else seed)

        def order(epoch: int) -> list[int]:
            sampler.set_epoch(epoch)
            return list(sampler)
    elif strategy == "sequential":
        def order(epoch: int) -> list[int]:
            return list(range(num_rows))
    else:
        raise ValueError(f"no replayable order for train_sampling_strategy={strategy!r}")

    return lambda epoch: _batches(order(epoch), batch_size, drop_last, num_processes)


def eval_batches(num_rows: int, *, batch_size: int, num_processes: int, drop_last: bool) -> RankBatches:
    """The eval loop's order: sequential, sharded across ranks with even batches."""
    return _batches(range(num_rows), batch_size, drop_last, num_processes)


def ordered_batches(order: Sequence[int], *, batch_size: int, num_processes: int, drop_last: bool) -> RankBatches:
    """Per-rank batches of a custom sampler's `order` (e.g. TRL's `RepeatSampler`), as the prepared DataLoader
    gives them: accelerate shards whole batches across ranks, since such a sampler is not a `RandomSampler`."""
    return _batches(order, batch_size, drop_last, num_processes)
