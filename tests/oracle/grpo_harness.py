"""The GRPO/RLOO shape oracle: a real `GRPOTrainer` or `RLOOTrainer` on CPU with the bundled tiny model,
recording every model input it makes, by phase and step. Plans are checked against this, never against the notes.

Phases are told apart by what runs, the way the plan names them:
    generate / eval_generate   the policy's `generate` (train / eval mode): the prefill's (batch, seq) and the
                               static cache length (None with a dynamic cache); decode forwards are not recorded
    train                      the policy's forward with grad
    old_logprob                the policy's no-grad forward in train mode, outside `generate`
    eval                       the policy's no-grad forward in eval mode, outside `generate`
    ref                        the reference model's forward
"""

from __future__ import annotations

import importlib
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shapeplan.trainers import TRAINERS
from tests.conftest import TINY_MODEL


@dataclass(frozen=True)
class Forward:
    phase: str
    batch: int
    seq: int
    step: int  # train side: the optimizer step being computed (1-based); eval side: global_step when it ran
    cache_len: int | None = None  # generate phases: the static cache length
    logits_to_keep: int | None = None  # what TRL passed to its log-prob helper for this forward


def completion_length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def run_generation_trainer(method: str, train_path: Path, argv: Sequence[str], *,
                           eval_path: Path | None = None) -> list[Forward]:
    """Train with `trl <method>`'s parser on `argv` (TRL options), recording what the models are fed."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, StaticCache

    parser = importlib.import_module(TRAINERS[method].script).make_parser()
    output_dir = tempfile.mkdtemp(prefix="shapeplan-oracle-")
    _, config, *_ = parser.parse_args_and_config([
        "--output_dir", output_dir, "--report_to", "none", "--use_cpu", "true", "--save_strategy", "no",
        "--logging_steps", "1000", "--bf16", "false", "--disable_tqdm", "true", *argv], return_remaining_strings=True)
    train = load_dataset("json", data_files=str(train_path), split="train")
    eval_ds = load_dataset("json", data_files=str(eval_path), split="train") if eval_path else None
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    trainer = TRAINERS[method].trainer()(model=model, reward_funcs=[completion_length_reward], args=config,
                                              train_dataset=train, eval_dataset=eval_ds)
    seen: list[Forward] = []
    state: dict[str, Any] = {"in_generate": False, "cache": None, "logits_to_keep": None}

    def step() -> int:
        return trainer.state.global_step + (1 if model.training else 0)

    generate = model.generate

    def recording_generate(*args: Any, **kwargs: Any) -> Any:
        state["in_generate"], state["cache"] = True, None
        try:
            return generate(*args, **kwargs)
        finally:
            state["in_generate"] = False

    model.generate = recording_generate

    logps = trainer._get_per_token_logps_and_entropies

    def recording_logps(model_: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, *args: Any,
                        **kwargs: Any) -> Any:
        state["logits_to_keep"] = logits_to_keep
        try:
            return logps(model_, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        finally:
            state["logits_to_keep"] = None

    trainer._get_per_token_logps_and_entropies = recording_logps

    def policy_hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if state["in_generate"]:
            cache = kwargs.get("cache")
            if state["cache"] is not None and cache is state["cache"]:
                return  # a decode step of the same call
            state["cache"] = cache
            static = isinstance(cache, StaticCache)
            seen.append(Forward("generate" if module.training else "eval_generate", int(ids.shape[0]),
                                int(ids.shape[1]), step(), cache_len=cache.get_max_length() if static else None))
            return
        phase = "train" if torch.is_grad_enabled() else "old_logprob" if module.training else "eval"
        seen.append(Forward(phase, int(ids.shape[0]), int(ids.shape[1]), step(),
                            logits_to_keep=state["logits_to_keep"]))

    def ref_hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append(Forward("ref", int(ids.shape[0]), int(ids.shape[1]), step(),
                            logits_to_keep=state["logits_to_keep"]))

    model.register_forward_pre_hook(policy_hook, with_kwargs=True)
    if trainer.ref_model is not None:
        trainer.ref_model.register_forward_pre_hook(ref_hook, with_kwargs=True)
    # The tiny model's decode steps are too small to share between threads: one thread runs them 3x faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    return seen


Key = tuple[str, int, int, int | None, int | None]


def observed(seen: Sequence[Forward]) -> dict[Key, tuple[int, int]]:
    """(phase, batch, seq, cache_len, logits_to_keep) -> (count, first step)."""
    keys = [(s.phase, s.batch, s.seq, s.cache_len, s.logits_to_keep) for s in seen]
    counts = Counter(keys)
    first: dict[Key, int] = {}
    for key, s in zip(keys, seen, strict=True):
        first.setdefault(key, s.step)
    return {k: (counts[k], first[k]) for k in counts}


def planned(plan: Any, *, certain_only: bool = False) -> dict[Key, tuple[int, int]]:
    return {(s.phase, s.batch, s.seq, s.cache_len, s.logits_to_keep): (s.count, s.first_step)
            for s in plan.shapes if s.certain or not certain_only}
