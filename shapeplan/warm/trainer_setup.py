"""What every warmer does to the real TRL trainer it drives, trainer loop or generation: its config set as
`trl <method>`'s main() sets it (`script_config`, with a scratch output dir), whether the planned run logs
(`run_logs`, `last_step_logs`), and its dataloaders replaced by exactly the planned batches (`use_batches`,
`prepared_loader`).
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import TrainingArguments
    from trl import ModelConfig


def run_logs(config: TrainingArguments, total_steps: int) -> bool:
    """Whether a run of `total_steps` optimizer steps logs at least once (`DefaultFlowCallback.on_step_end` /
    `on_epoch_end`): a log runs a few scalar reductions, which the warm-up then runs once."""
    strategy = str(getattr(config.logging_strategy, "value", config.logging_strategy))
    if strategy == "epoch" or (config.logging_first_step and total_steps >= 1):
        return True
    if strategy != "steps":
        return False
    every = math.ceil(total_steps * config.logging_steps) if config.logging_steps < 1 else int(config.logging_steps)
    return total_steps >= every


def last_step_logs(config: TrainingArguments, total_steps: int) -> bool:
    """Whether a run of `total_steps` optimizer steps logs at its last one (`DefaultFlowCallback`; with the epoch
    strategy the Trainer ends every epoch with a log, one that `max_steps` cuts short too). A log resets the
    Trainer's flos count to the int 0, which several ranks gather at the end of training (`store_flos`) as an int64
    tensor, else as a float32 one."""
    strategy = str(getattr(config.logging_strategy, "value", config.logging_strategy))
    if (config.logging_first_step and total_steps == 1) or strategy == "epoch":
        return True
    if strategy != "steps":
        return False
    every = math.ceil(total_steps * config.logging_steps) if config.logging_steps < 1 else int(config.logging_steps)
    return total_steps % max(every, 1) == 0



def script_config(cfg: Any, model_args: ModelConfig) -> None:
    """Set `cfg` as `trl <method>`'s main() does (the model's init kwargs), and turn off what only steers the run's
    bookkeeping: no checkpoints, reports or progress bars of the trainer's own, evaluation only where the warmer
    asks for it."""
    from transformers.trainer_utils import IntervalStrategy, SaveStrategy

    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=cfg.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(cfg.model_init_kwargs or {})
    cfg.model_init_kwargs = model_init_kwargs
    cfg.output_dir = _scratch_output_dir()
    cfg.report_to = []
    cfg.save_strategy = SaveStrategy.NO
    cfg.eval_strategy = IntervalStrategy.NO
    cfg.load_best_model_at_end = False
    cfg.push_to_hub = False
    cfg.disable_tqdm = True


def _scratch_output_dir() -> str:
    """The trainer's output_dir, which the warm-up saves nothing into: removed when this process exits, and by the
    next warm-up if this one is killed first."""
    import atexit
    import shutil

    from ..plan.io import remove_stale

    remove_stale(Path(tempfile.gettempdir()), "shapeplan-warm-")
    folder = tempfile.mkdtemp(prefix=f"shapeplan-warm-{os.getpid()}-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


# rows, the row indices of each batch, the run's batch size, the remainder its dataloader reports
Batches = tuple[list[dict[str, Any]], list[list[int]], int, int]


def use_batches(trainer: Any, train: Batches, passes: list[Batches], ranks: int) -> None:
    """Make the trainer's dataloaders yield exactly these batches on this rank, collated and prepared as the
    Trainer does: the train batches, and each eval pass's in turn; `ranks`: the run's data-parallel ranks."""
    import datasets

    train_set = datasets.Dataset.from_list(train[0])
    trainer.train_dataset = train_set
    trainer.get_train_dataloader = lambda: prepared_loader(trainer, train_set, *train[1:], "training", ranks)
    if not passes:
        return
    eval_sets = iter([(datasets.Dataset.from_list(p[0]), p) for p in passes])
    trainer.eval_dataset = datasets.Dataset.from_list(passes[0][0])

    def eval_loader(eval_dataset: Any = None) -> Any:
        dataset, (_, index, batch_size, remainder) = next(eval_sets)
        return prepared_loader(trainer, dataset, index, batch_size, remainder, "evaluation", ranks)

    trainer.get_eval_dataloader = eval_loader


class _FixedBatches:
    """A batch sampler with a fixed list of batches (the Trainer's own samplers pick rows at random); its
    `batch_size` and `num_processes` are the run's, for accelerate's end-of-dataloader bookkeeping."""

    def __init__(self, batches: list[list[int]], batch_size: int, num_processes: int) -> None:
        self.batches = batches
        self.batch_size = batch_size
        self.num_processes = num_processes
        self.drop_last = False

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


class _Rows:
    """The synthetic rows, reporting the length that gives accelerate the run's remainder."""

    def __init__(self, rows: Any, total_dataset_length: int) -> None:
        self.rows = rows
        self.total_dataset_length = total_dataset_length

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)


def prepared_loader(trainer: Any, dataset: Any, index: list[list[int]], batch_size: int, remainder: int,
                    description: str, ranks: int = 1) -> Any:
    """A dataloader of exactly these batches on this rank, prepared as the trainer's accelerator prepares the
    Trainer's but not sharded across ranks (the warm-up gives each rank its own batches), whose end-of-data
    bookkeeping reports `remainder` (what `gather_for_metrics` cuts the last batch's gathered values to) out of
    `ranks` batches of `batch_size` (accelerate's `total_batch_size`)."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, Dataset

    dataset = trainer._remove_unused_columns(dataset, description=description)
    rows = cast("Dataset[Any]", _Rows(dataset, batch_size * ranks + remainder))  # map-style: __getitem__, __len__
    loader: DataLoader[Any] = DataLoader(rows, batch_sampler=_FixedBatches(index, batch_size, ranks),
                                         collate_fn=trainer.data_collator, num_workers=0)
    accelerator = trainer.accelerator
    # The plan already dealt each rank its batches (split, dispatched or not): they are prepared as they are.
    prepared = prepare_data_loader(
        loader, accelerator.device, num_processes=1, process_index=0, split_batches=False,
        put_on_device=accelerator.device_placement, rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False, even_batches=True,
        use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking, use_stateful_dataloader=accelerator.use_stateful_dataloader)
    accelerator._dataloaders.append(prepared)
    return prepared


def callback_base():
    """transformers' `TrainerCallback`, imported when a warmer module is (the base of the warmers' callbacks)."""
    from transformers import TrainerCallback

    return TrainerCallback
