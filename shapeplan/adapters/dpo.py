"""DPO: prepared lengths from TRL's own `DPOTrainer._prepare_dataset`, and the batch order, into `plan_dpo`."""

from __future__ import annotations

from typing import Any

from ..plan.batches import RunInfo
from ..plan.dpo import DPOLayout, plan_dpo
from ..plan.model import Plan
from ..plan.preference import PairedRows
from .common import load_run_data, recorded_config, versions
from .data import tokenizer_fingerprint
from .loop import eval_schedule, sequential_pass, train_schedule
from .preference import check_columns, check_not_empty, list_lengths, prepare
from .trl_args import TrainingArgs

COLUMNS = (("chosen", "rejected"),)


def _bare_trainer(tokenizer: Any) -> Any:
    """A `DPOTrainer` with only what `_prepare_dataset` reads, set as `DPOTrainer.__init__` sets it."""
    from trl import DPOTrainer

    trainer = DPOTrainer.__new__(DPOTrainer)
    trainer._tokenizer = tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return trainer


def prepare_rows(dataset: Any, tokenizer: Any, config: Any, name: str) -> tuple[PairedRows, int]:
    """Prompt+chosen and prompt+rejected lengths of the rows DPO trains on, and how many rows preparation dropped."""
    check_columns(dataset, "DPO", name, COLUMNS)
    prepared = prepare(_bare_trainer(tokenizer), dataset, tokenizer, config, name)
    prompt, chosen, rejected = list_lengths(prepared, "prompt_ids", "chosen_ids", "rejected_ids")
    check_not_empty(len(prompt), name, config.max_length, "every prompt reaches")
    rows = PairedRows(chosen=tuple(p + c for p, c in zip(prompt, chosen)),
                      rejected=tuple(p + r for p, r in zip(prompt, rejected)))
    return rows, len(dataset) - len(rows)


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    config = args.training
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
    return plan_dpo(
        train_rows=train_rows,
        layout=DPOLayout(max_length=config.max_length, precompute_ref=precompute),
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
