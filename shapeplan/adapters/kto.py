"""KTO: prepared lengths (rows and their KL rows) from TRL's own `KTOTrainer._prepare_dataset`, into `plan_kto`."""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from ..plan.batches import RunInfo
from ..plan.kto import KTOLayout, UnpairedRows, plan_kto
from ..plan.model import Plan
from .common import load_run_data, recorded_config, versions
from .data import tokenizer_fingerprint
from .loop import eval_schedule, sequential_pass, train_schedule
from .preference import check_columns, check_not_empty, list_lengths, prepare
from .trl_args import TrainingArgs

# Unpaired rows, or paired rows that preparation unpairs into two.
COLUMNS = (("prompt", "completion", "label"), ("chosen", "rejected"))


def _uses_kl(config: Any) -> bool:
    return config.loss_type not in ("apo_zero_unpaired",)


def _bare_trainer(tokenizer: Any, config: Any) -> Any:
    """A `KTOTrainer` with only what `_prepare_dataset` reads, set as `KTOTrainer.__init__` sets it."""
    from trl import KTOTrainer

    trainer = KTOTrainer.__new__(KTOTrainer)
    trainer._tokenizer = tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    trainer.calculate_KL = _uses_kl(config)
    trainer.desirable_weight = config.desirable_weight
    trainer.undesirable_weight = config.undesirable_weight
    return trainer


def prepare_rows(dataset: Any, tokenizer: Any, config: Any, name: str) -> tuple[UnpairedRows, int]:
    """The lengths of the rows KTO trains on and of their KL rows, and how many (unpaired) rows preparation dropped."""
    check_columns(dataset, "KTO", name, COLUMNS)
    paired = {"chosen", "rejected"} <= set(dataset.column_names)
    prepared = prepare(_bare_trainer(tokenizer, config), dataset, tokenizer, config, name)
    kl = _uses_kl(config)
    columns = ("prompt_ids", "completion_ids", "KL_completion_ids") if kl else ("prompt_ids", "completion_ids")
    prompt, completion, *kl_completion = list_lengths(prepared, *columns)
    check_not_empty(len(prompt), name, config.max_length, "every prompt reaches")
    rows = UnpairedRows(
        lengths=tuple(p + c for p, c in zip(prompt, completion)),
        kl_lengths=tuple(p + c for p, c in zip(prompt, kl_completion[0])) if kl else None,
    )
    return rows, len(dataset) * (2 if paired else 1) - len(rows)


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    config = args.training
    if _uses_kl(config):  # KTOTrainer.__init__ refuses these
        if config.train_sampling_strategy != "sequential":
            raise UsageError(f"loss_type={config.loss_type!r} estimates a KL term, which needs "
                             "--train_sampling_strategy sequential (KTO's default)")
        if config.per_device_train_batch_size <= 1:
            raise UsageError(f"loss_type={config.loss_type!r} estimates a KL term, which needs "
                             "--per_device_train_batch_size 2 or more")
    data = load_run_data(args, eval_source=eval_source)
    train_rows, dropped = prepare_rows(data.train, data.tokenizer, config, "train")
    epoch_batches, loop = train_schedule(args, len(train_rows))
    precompute = bool(config.precompute_ref_log_probs)
    ref_batch = config.precompute_ref_batch_size
    eval_rows = None
    eval_order: Any = ()
    eval_at: list[int] = []
    if data.eval is not None:
        eval_rows, _ = prepare_rows(data.eval, data.tokenizer, config, "eval")
        eval_order, eval_at = eval_schedule(args, loop, len(eval_rows))
    return plan_kto(
        train_rows=train_rows,
        layout=KTOLayout(max_length=config.max_length, precompute_ref=precompute),
        loop=loop,
        epoch_batches=epoch_batches,
        eval_rows=eval_rows,
        eval_batches=eval_order,
        eval_steps=eval_at,
        precompute_batches=sequential_pass(args, len(train_rows), ref_batch or config.per_device_train_batch_size)
        if precompute else (),
        eval_precompute_batches=sequential_pass(args, len(eval_rows), ref_batch or config.per_device_eval_batch_size)
        if precompute and eval_rows is not None else (),
        info=RunInfo(
            rows=len(train_rows),
            pad_to_multiple_of=config.pad_to_multiple_of,
            dropped_rows=dropped,
            config=recorded_config(args, argv),
            versions=versions(),
            fingerprint={"tokenizer": tokenizer_fingerprint(data.tokenizer), "train_dataset": data.train._fingerprint,
                         **({"eval_dataset": data.eval._fingerprint} if data.eval is not None else {})},
        ),
    )
