"""DPO: prepared lengths from TRL's own `DPOTrainer._prepare_dataset`, and the batch order, into `plan_dpo`."""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from ..plan.dpo import DPOLayout, plan_dpo
from ..plan.model import Plan
from ..plan.preference import PairedRows
from .loop import sharding
from .preference import (
    Preparation,
    plan_inputs,
    prepare_run,
)
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


def preparation(tokenizer: Any, config: Any) -> Preparation[PairedRows]:
    """Prompt+chosen and prompt+rejected lengths of the rows DPO trains on."""
    def build(columns: list[list[Any]]) -> PairedRows:
        prompt, chosen, rejected = columns
        return PairedRows(chosen=tuple(p + c for p, c in zip(prompt, chosen, strict=True)),
                          rejected=tuple(p + r for p, r in zip(prompt, rejected, strict=True)), prompt=tuple(prompt))

    return Preparation(trainer="DPO", accepted=COLUMNS, bare=_bare_trainer(tokenizer),
                       lengths=("prompt_ids", "chosen_ids", "rejected_ids"), build=build,
                       dropped_because="every prompt reaches")


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    if args.training.precompute_ref_log_probs and sharding(args).dispatch_batches:
        # the collator adds one log-prob per pair to batches of two sequences per pair; rank 0 slices both alike
        raise UsageError("dispatch_batches=true with precompute_ref_log_probs: rank 0 slices each batch's reference "
                         "log-probs (one per pair) by the rows of its sequences (two per pair), so a rank gets "
                         "another rank's log-probs or none and the loss fails; drop dispatch_batches or "
                         "precompute_ref_log_probs")
    run = prepare_run(args, argv, eval_source, preparation)
    return plan_dpo(layout=DPOLayout(max_length=args.training.max_length,
                                     precompute_ref=args.training.precompute_ref_log_probs,
                                     truncation_mode=args.training.truncation_mode),
                    **plan_inputs(args, run))
