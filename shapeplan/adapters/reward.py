"""Reward: prepared chosen/rejected lengths from TRL's own `RewardTrainer._prepare_dataset`, into `plan_reward`."""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from ..plan.model import Plan
from ..plan.preference import PairedRows
from ..plan.reward import plan_reward
from .common import apply_chat_template_path
from .preference import (
    check_columns,
    check_not_empty,
    list_lengths,
    prepare,
    prepare_run,
)
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
    apply_chat_template_path(tokenizer, config.chat_template_path)


def prepare_rows(dataset: Any, tokenizer: Any, config: Any, name: str) -> tuple[PairedRows, int]:
    """Chosen and rejected lengths of the rows the reward model trains on, and how many rows preparation dropped."""
    from trl import RewardTrainer

    check_columns(dataset, "Reward", name, COLUMNS)
    prepared = prepare(RewardTrainer.__new__(RewardTrainer), dataset, tokenizer, config, name)
    chosen, rejected = list_lengths(prepared, "chosen_ids", "rejected_ids")
    check_not_empty(len(chosen), name, config.max_length, "every row has a side longer than")
    return PairedRows(chosen=tuple(chosen), rejected=tuple(rejected)), len(dataset) - len(chosen)


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    run = prepare_run(args, argv, eval_source, prepare_rows, setup_tokenizer=_set_tokens)
    return plan_reward(train_rows=run.train_rows, loop=run.loop, epoch_batches=run.epoch_batches, info=run.info,
                       eval_rows=run.eval_rows, eval_batches=run.eval_batches, eval_steps=run.eval_steps)
