"""Reward: prepared chosen/rejected lengths from TRL's own `RewardTrainer._prepare_dataset`, into `plan_reward`."""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from ..plan.batches import RunInfo
from ..plan.model import Plan
from ..plan.preference import PairedRows
from ..plan.reward import plan_reward
from .common import load_run_data, recorded_config, versions
from .data import tokenizer_fingerprint
from .loop import eval_schedule, train_schedule
from .preference import check_columns, check_not_empty, list_lengths, prepare
from .sft import _apply_chat_template_path
from .trl_args import TrainingArgs

# Text (or messages) to tokenize, or rows tokenized already.
COLUMNS = (("chosen", "rejected"), ("chosen_ids", "rejected_ids"))


def _set_tokens(tokenizer: Any, config: Any) -> None:
    """The tokenizer changes `RewardTrainer.__init__` makes before preparing data."""
    if config.eos_token is not None:
        if config.eos_token not in tokenizer.get_vocab():
            raise UsageError(f"eos_token {config.eos_token!r} is not in the tokenizer's vocabulary; "
                             "pass a token the tokenizer has with --eos_token")
        tokenizer.eos_token = config.eos_token
    _apply_chat_template_path(tokenizer, config.chat_template_path)


def prepare_rows(dataset: Any, tokenizer: Any, config: Any, name: str) -> tuple[PairedRows, int]:
    """Chosen and rejected lengths of the rows the reward model trains on, and how many rows preparation dropped."""
    from trl import RewardTrainer

    check_columns(dataset, "Reward", name, COLUMNS)
    prepared = prepare(RewardTrainer.__new__(RewardTrainer), dataset, tokenizer, config, name)
    chosen, rejected = list_lengths(prepared, "chosen_ids", "rejected_ids")
    check_not_empty(len(chosen), name, config.max_length, "every row has a side longer than")
    return PairedRows(chosen=tuple(chosen), rejected=tuple(rejected)), len(dataset) - len(chosen)


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    config = args.training
    data = load_run_data(args, eval_source=eval_source)
    _set_tokens(data.tokenizer, config)
    train_rows, dropped = prepare_rows(data.train, data.tokenizer, config, "train")
    epoch_batches, loop = train_schedule(args, len(train_rows))
    eval_rows = None
    eval_order: Any = ()
    eval_at: list[int] = []
    if data.eval is not None:
        eval_rows, _ = prepare_rows(data.eval, data.tokenizer, config, "eval")
        eval_order, eval_at = eval_schedule(args, loop, len(eval_rows))
    return plan_reward(
        train_rows=train_rows,
        loop=loop,
        epoch_batches=epoch_batches,
        eval_rows=eval_rows,
        eval_batches=eval_order,
        eval_steps=eval_at,
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
