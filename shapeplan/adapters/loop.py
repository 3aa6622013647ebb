"""The Trainer's loop for a run: train batch order and schedule, eval batches and evaluation steps, and the
sequential passes trainers make over their data before training (reference precompute)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from ..errors import UsageError
from ..plan.rows import UnequalParts
from ..plan.schedule import TrainLoop, evaluation_steps
from .common import streamed
from .sampling import (
    TRAIN_STRATEGIES,
    RankBatches,
    Sharding,
    eval_batches,
    ordered_batches,
    train_batches,
)
from .trl_args import TrainingArgs


def sharding(args: TrainingArgs) -> Sharding:
    """How the run's dataloaders are dealt to its ranks (`Trainer.create_accelerator_and_postprocess` passes these
    `accelerator_config` options to accelerate's `DataLoaderConfiguration`)."""
    accelerator = args.training.accelerator_config
    # Every trainer forces (or requires) dispatch_batches=False on a stream; on one process it changes no batch.
    dispatch = bool(accelerator.dispatch_batches) and args.num_processes > 1 and not streamed(args)
    collated = args.spec.collated
    if dispatch and collated == "examples":
        # accelerate's `concatenate` (without split_batches) and `broadcast` (with it) take tensors only
        raise UsageError(f"dispatch_batches=true on several ranks: rank 0 would concatenate or broadcast "
                         f"{args.method}'s batches, which are lists of example dicts holding strings, and "
                         "accelerate fails on them (TypeError); drop dispatch_batches from --accelerator_config")
    return Sharding(num_processes=args.num_processes, split_batches=bool(accelerator.split_batches),
                    even_batches=bool(accelerator.even_batches), dispatch_batches=dispatch,
                    halves=collated == "halves")


@contextmanager
def dispatched_parts() -> Iterator[None]:
    """Around planning dispatched batches: rank 0 concatenates the batches it dispatches (torch.cat), which fails on
    parts padded to other lengths."""
    try:
        yield
    except UnequalParts as exc:
        raise UsageError(f"dispatch_batches=true: rank 0 concatenates batches padded to "
                         f"{' and '.join(map(str, exc.seqs))} tokens, which accelerate fails on; add split_batches "
                         "(rank 0 then pads each whole batch), pad every batch alike (--pad_to_multiple_of, "
                         "--max_length), or drop dispatch_batches") from None


def check_strategy(args: TrainingArgs, *, length_aware: bool) -> None:
    """Refuse a train_sampling_strategy the planner cannot replay: the length-aware ones need the rows' lengths
    (`length_aware`, SFT's planner passes them)."""
    strategy = args.training.train_sampling_strategy
    planned = TRAIN_STRATEGIES if length_aware else ("random", "sequential")
    if strategy not in planned:
        raise UsageError(f"train_sampling_strategy={strategy!r} is not one shapeplan plans; use one of "
                         f"{', '.join(planned)}")
    if strategy == "batch_rebalance" and args.training.accelerator_config.split_batches:
        # The Trainer passes it as a batch_sampler, which has no batch_size for split_batches to split.
        raise UsageError("accelerate refuses split_batches with train_sampling_strategy='batch_rebalance' (its batch "
                         "sampler has no batch_size to split); drop split_batches or pick another strategy")


def train_schedule(args: TrainingArgs, num_rows: int,
                   lengths: Sequence[int] | None = None) -> tuple[Callable[[int], RankBatches], TrainLoop]:
    """The train batch order and loop; `lengths` (the rows' token lengths) for the length-aware strategies."""
    config = args.training
    check_strategy(args, length_aware=lengths is not None)
    shards = sharding(args)
    batch_size = config.per_device_train_batch_size
    if config.train_sampling_strategy != "batch_rebalance":  # it is refused with split_batches above
        shards.rank_batch_size(batch_size, "per_device_train_batch_size")
    epoch_batches = train_batches(
        num_rows, batch_size=batch_size, sharding=shards,
        strategy=config.train_sampling_strategy, seed=config.seed, data_seed=config.data_seed,
        drop_last=config.dataloader_drop_last, lengths=lengths or (),
        gradient_accumulation_steps=config.gradient_accumulation_steps,
    )
    return epoch_batches, train_loop(args, epoch_batches)


def train_loop(args: TrainingArgs, epoch_batches: Callable[[int], RankBatches]) -> TrainLoop:
    """The Trainer's loop over `epoch_batches` (its first epoch's length is the dataloader's)."""
    config = args.training
    loop = TrainLoop(
        steps_in_epoch=len(epoch_batches(0)[0]),
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        num_train_epochs=config.num_train_epochs,
        max_steps=config.max_steps,
    )
    check_walk(args, micro_batches=loop.epochs * loop.steps_in_epoch, per_pass=loop.steps_in_epoch)
    return loop


# A plan replays every micro-batch of every rank (about 25,000 a second on one core), after accelerate has dealt
# each pass's batches to the ranks (each rank walks every batch: ranks x batches steps, about five times cheaper).
# Ten passes over the data are planned whatever its size (the cost grows with the data, as tokenizing it does); more
# passes up to this cost: a run that re-reads a small dataset millions of times is refused in a second instead.
MAX_PASSES = 10
MAX_WALK = 2_000_000


def check_walk(args: TrainingArgs, *, micro_batches: int, per_pass: int) -> None:
    """Refuse a run whose `micro_batches` per rank (`per_pass` in each pass over the data) cost more to replay than
    MAX_PASSES passes or MAX_WALK, naming the settings behind them."""
    ranks = args.num_processes
    deal = ranks * (per_pass * ranks + ranks) if ranks > 1 else 0
    pass_cost = per_pass * ranks + deal // 5
    passes = -(-micro_batches // max(per_pass, 1))
    if passes * pass_cost <= max(MAX_WALK, MAX_PASSES * pass_cost):
        return
    config = args.training
    setting = (f"--max_steps {config.max_steps}" if config.max_steps > 0
               else f"--num_train_epochs {config.num_train_epochs:g}")
    if ranks > 1:
        setting += f" on --num_processes {ranks}"
    raise UsageError(f"{setting} reads the data {passes:,} times over ({per_pass:,} micro-batches "
                     f"per pass and rank), {passes * pass_cost:,} replay steps, more than shapeplan replays "
                     f"({MAX_WALK:,}); a run that long re-reads the same data: plan it with fewer steps, epochs or "
                     "processes, or pass the run's real values")


def sampled_epochs(args: TrainingArgs, sampler: Iterable[int], batch_size: int,
                   option: str) -> Callable[[int], RankBatches]:
    """epoch -> per-rank batches of a custom sampler (TRL's `RepeatSampler`) that draws a new order at each pass,
    as the prepared DataLoader gives them; `option` names the setting the dataloader's `batch_size` comes from."""
    drawn: list[RankBatches] = []  # the latest epoch's batches; the planner asks for epochs in order
    shards = sharding(args)
    shards.rank_batch_size(batch_size, option)

    def epoch_batches(epoch: int) -> RankBatches:
        while len(drawn) <= epoch:
            drawn.append(ordered_batches(list(sampler), batch_size=batch_size, sharding=shards,
                                         drop_last=args.training.dataloader_drop_last))
            if len(drawn) > 1:
                drawn[-2] = []  # free the previous epoch
        return drawn[epoch]

    return epoch_batches


def eval_steps_of(args: TrainingArgs, loop: TrainLoop) -> list[int]:
    """The global steps after which the eval loop runs."""
    config = args.training
    strategy = config.eval_strategy
    return evaluation_steps(loop, eval_strategy=str(getattr(strategy, "value", strategy)),
                            eval_steps=config.eval_steps, eval_delay=config.eval_delay or 0,
                            eval_on_start=config.eval_on_start)


def eval_schedule(args: TrainingArgs, loop: TrainLoop, num_rows: int,
                  lengths: Sequence[int] | None = None) -> tuple[RankBatches, list[int]]:
    """The eval loop's batches and the global steps after which it runs; `lengths` (the rows' token lengths) for
    group_by_length, whose eval sampler is seeded (`data_seed`, else `seed`)."""
    config = args.training
    at = eval_steps_of(args, loop)
    grouped = lengths if config.train_sampling_strategy == "group_by_length" else None
    shards = sharding(args)
    shards.rank_batch_size(config.per_device_eval_batch_size, "per_device_eval_batch_size")
    batches = eval_batches(num_rows, batch_size=config.per_device_eval_batch_size, sharding=shards,
                           drop_last=config.dataloader_drop_last, grouped_lengths=grouped,
                           seed=config.data_seed if config.data_seed is not None else config.seed)
    return batches, at


def sequential_pass(args: TrainingArgs, num_rows: int, batch_size: int, option: str) -> RankBatches:
    """A `DataLoader(shuffle=False)` prepared by accelerate, as TRL builds for precompute passes (never drop_last);
    `option` names the setting `batch_size` comes from."""
    shards = sharding(args)
    shards.rank_batch_size(batch_size, option)
    return eval_batches(num_rows, batch_size=batch_size, sharding=shards, drop_last=False)
