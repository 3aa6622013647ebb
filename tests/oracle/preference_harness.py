"""The shape oracle for DPO, KTO and Reward: the real TRL trainer on CPU with the bundled tiny model, recording every
forward the policy and the reference model receive, by phase and step.

Phases are told apart from what is running, not from the plan's rules: the policy in train mode with grad is
`train`; without grad (KTO's KL pass) `kl`; in eval mode (the eval loop) `eval`, or `eval_kl` inside KTO's KL
pass; the separate reference model is `ref`/`ref_kl` while the policy trains and `eval_ref`/`eval_ref_kl` in the
eval loop; any forward while the trainer is still being constructed is the reference precompute pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.conftest import TINY_MODEL
from tests.oracle.harness import Seen, unpadded

TRAINERS = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "reward": "RewardTrainer"}


@dataclass(frozen=True)
class Run:
    seen: list[Seen]
    train_rows: int  # rows of the train dataset after the trainer prepared it
    optimizer_steps: int


def _parse(method: str, argv: Sequence[str]) -> tuple[Any, Any]:
    import importlib

    parser = importlib.import_module(f"trl.scripts.{method}").make_parser()
    script, config, *_ = parser.parse_args_and_config(list(argv), return_remaining_strings=True)
    return script, config


def run_preference(method: str, train_path: Path, argv: Sequence[str], *,
                   eval_path: Path | None = None) -> Run:
    """Train `trl <method>`'s trainer on `argv` (TRL options), recording what each model is fed."""
    import trl
    from datasets import load_dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    # The tiny model's ops are too small to share across threads; on a busy 2-core box threads triple the time.
    torch.set_num_threads(1)
    _, config = _parse(method, [
        "--output_dir", "/tmp/shapeplan-oracle", "--report_to", "none", "--use_cpu", "true",
        "--save_strategy", "no", "--logging_steps", "1000", "--bf16", "false", "--disable_tqdm", "true",
        # recomputing activations costs CPU time and never reaches the model's top-level forward the hooks watch
        "--gradient_checkpointing", "false", *argv])
    train = load_dataset("json", data_files=str(train_path), split="train")
    eval_ds = load_dataset("json", data_files=str(eval_path), split="train") if eval_path else None
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    if method == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(TINY_MODEL, num_labels=1, dtype="float32")
    else:
        model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype="float32")

    seen: list[Seen] = []
    state: dict[str, Any] = {"trainer": None, "kl": False}

    def record(phase: str, ids: torch.Tensor, kwargs: dict[str, Any]) -> None:
        trainer = state["trainer"]
        if trainer is None:
            phase, step = "ref_precompute", 0
        else:
            step = trainer.state.global_step + (0 if phase.startswith("eval") else 1)
        seen.append(Seen(phase, int(ids.shape[0]), int(ids.shape[1]), step, unpadded=unpadded(kwargs)))

    def input_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        return kwargs.get("input_ids", args[0] if args else None)

    def policy_hook(module, args, kwargs):  # type: ignore[no-untyped-def]
        if module.training:
            phase = "train" if torch.is_grad_enabled() else "kl"
        else:
            phase = "eval_kl" if state["kl"] else "eval"
        record(phase, input_ids(args, kwargs), kwargs)

    def ref_hook(module, args, kwargs):  # type: ignore[no-untyped-def]
        phase = "ref_kl" if state["kl"] else "ref"
        record(phase if state["trainer"].model.training else f"eval_{phase}", input_ids(args, kwargs), kwargs)

    model.register_forward_pre_hook(policy_hook, with_kwargs=True)
    trainer_cls = getattr(trl, TRAINERS[method])
    trainer = trainer_cls(model=model, args=config, train_dataset=train, eval_dataset=eval_ds,
                          processing_class=tokenizer)
    state["trainer"] = trainer
    ref_model = getattr(trainer, "ref_model", None)
    if ref_model is not None:
        assert ref_model is not model
        ref_model.register_forward_pre_hook(ref_hook, with_kwargs=True)
    if method == "kto":
        compute_kl_logps = trainer._compute_kl_logps

        def marked(*args: Any, **kwargs: Any) -> Any:
            state["kl"] = True
            try:
                return compute_kl_logps(*args, **kwargs)
            finally:
                state["kl"] = False

        trainer._compute_kl_logps = marked
    trainer.train()
    return Run(seen=seen, train_rows=len(trainer.train_dataset), optimizer_steps=trainer.state.global_step)
