"""The Trainer's loop for a run: train batch order and schedule, eval batches and evaluation steps, and the
sequential passes trainers make over their data before training (reference precompute)."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import UsageError
from ..plan.schedule import TrainLoop, evaluation_steps
from .sampling import RankBatches, eval_batches, train_batches
from .trl_args import TrainingArgs


def train_schedule(args: TrainingArgs, num_rows: int) -> tuple[Callable[[int], RankBatches], TrainLoop]:
    config = args.training
    strategy = config.train_sampling_strategy
    if strategy not in ("random", "sequential"):
        raise UsageError(f"train_sampling_strategy={strategy!r} draws its order from the global RNG and is not "
                         "planned yet; use 'random' or 'sequential'")
    epoch_batches = train_batches(
        num_rows, batch_size=config.per_device_train_batch_size, num_processes=args.num_processes,
        strategy=strategy, seed=config.seed, data_seed=config.data_seed, drop_last=config.dataloader_drop_last,
    )
    loop = TrainLoop(
        steps_in_epoch=len(epoch_batches(0)[0]),
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        num_train_epochs=config.num_train_epochs,
        max_steps=config.max_steps,
    )
    return epoch_batches, loop


def eval_schedule(args: TrainingArgs, loop: TrainLoop, num_rows: int) -> tuple[RankBatches, list[int]]:
    """The eval loop's batches and the global steps after which it runs."""
    config = args.training
    strategy = config.eval_strategy
    at = evaluation_steps(loop, eval_strategy=str(getattr(strategy, "value", strategy)),
                          eval_steps=config.eval_steps, eval_delay=config.eval_delay or 0,
                          eval_on_start=config.eval_on_start)
    batches = eval_batches(num_rows, batch_size=config.per_device_eval_batch_size, num_processes=args.num_processes,
                           drop_last=config.dataloader_drop_last)
    return batches, at


def sequential_pass(args: TrainingArgs, num_rows: int, batch_size: int) -> RankBatches:
    """A `DataLoader(shuffle=False)` prepared by accelerate, as TRL builds for precompute passes (never drop_last)."""
    return eval_batches(num_rows, batch_size=batch_size, num_processes=args.num_processes, drop_last=False)
