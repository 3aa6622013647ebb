"""KTO: prepared lengths (rows and their KL rows) from TRL's own `KTOTrainer._prepare_dataset`, into `plan_kto`."""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from ..plan.kto import KTOLayout, UnpairedRows, plan_kto
from ..plan.model import Plan
from .preference import (
    Preparation,
    plan_inputs,
    prepare_run,
)
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


def preparation(tokenizer: Any, config: Any) -> Preparation[UnpairedRows]:
    """The lengths of the rows KTO trains on and of their KL rows, and the rows' labels."""
    kl = _uses_kl(config)

    def build(columns: list[list[Any]]) -> UnpairedRows:
        prompt, completion, *kl_completion, labels = columns
        return UnpairedRows(
            lengths=tuple(p + c for p, c in zip(prompt, completion, strict=True)),
            kl_lengths=tuple(p + c for p, c in zip(prompt, kl_completion[0], strict=True)) if kl else None,
            prompt=tuple(prompt),
            labels=tuple(bool(label) for label in labels),
        )

    def rows_per_example(dataset: Any) -> int:  # paired rows are unpaired into two
        return 2 if {"chosen", "rejected"} <= set(dataset.column_names) else 1

    return Preparation(trainer="KTO", accepted=COLUMNS, bare=_bare_trainer(tokenizer, config),
                       lengths=("prompt_ids", "completion_ids", *(("KL_completion_ids",) if kl else ())),
                       values=("label",), build=build, dropped_because="every prompt reaches",
                       rows_per_example=rows_per_example)


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    config = args.training
    if _uses_kl(config):  # KTOTrainer.__init__ refuses these
        if config.train_sampling_strategy != "sequential":
            raise UsageError(f"loss_type={config.loss_type!r} estimates a KL term, which needs "
                             "--train_sampling_strategy sequential (KTO's default)")
        if config.per_device_train_batch_size <= 1:
            raise UsageError(f"loss_type={config.loss_type!r} estimates a KL term, which needs "
                             "--per_device_train_batch_size 2 or more")
    run = prepare_run(args, argv, eval_source, preparation)
    return plan_kto(layout=KTOLayout(max_length=config.max_length, precompute_ref=config.precompute_ref_log_probs),
                    **plan_inputs(args, run))
