"""Reward: prepared chosen/rejected lengths from TRL's own `RewardTrainer._prepare_dataset`, into `plan_reward`."""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from ..plan.model import Plan
from ..plan.preference import PairedRows
from ..plan.reward import plan_reward
from .common import apply_chat_template_path
from .preference import Preparation, prepare_run
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


def preparation(tokenizer: Any, config: Any) -> Preparation[PairedRows]:
    """Chosen and rejected lengths of the rows the reward model trains on."""
    from trl import RewardTrainer

    def build(columns: list[list[Any]]) -> PairedRows:
        chosen, rejected = columns
        return PairedRows(chosen=tuple(chosen), rejected=tuple(rejected))

    return Preparation(trainer="Reward", accepted=COLUMNS, bare=RewardTrainer.__new__(RewardTrainer),
                       lengths=("chosen_ids", "rejected_ids"), build=build,
                       dropped_because="every row has a side longer than")


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    run = prepare_run(args, argv, eval_source, preparation, setup_tokenizer=_set_tokens)
    return plan_reward(train_rows=run.train_rows, loop=run.loop, epoch_batches=run.epoch_batches, info=run.info,
                       eval_rows=run.eval_rows, eval_batches=run.eval_batches, eval_steps=run.eval_steps)
