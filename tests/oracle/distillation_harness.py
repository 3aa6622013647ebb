"""The Distillation shape oracle: a real `DistillationTrainer` on CPU, the bundled tiny model as student and teacher,
recording every model input it makes, by phase and step. Plans are checked against this, never against the notes.

Phases are told apart by what runs, the way the plan names them:
    generate / eval_generate   the student's `generate` (train / eval mode): the prefill's (batch, seq) and the
                               static cache length (None with a dynamic cache); decode forwards are not recorded
    train / eval               the student's backbone (what receives `input_ids` in `_get_last_hidden_state`), with
                               grad in train mode / without grad in eval mode
    teacher / eval_teacher     the teacher's backbone during a train step / in the eval loop
`logits_to_keep` is what the trainer passes to `_get_last_hidden_state`; the backbone's own `logits_to_keep`
keyword is recorded too, to check it is that value + 1.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.conftest import TINY_MODEL
from tests.oracle.grpo_harness import Forward


def run_distillation_trainer(train_path: Path, argv: Sequence[str], *,
                             eval_path: Path | None = None) -> list[Forward]:
    """Train with `trl distillation`'s parser on `argv` (TRL options), recording what the models are fed."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, StaticCache
    from trl import DistillationTrainer
    from trl.scripts.distillation import make_parser

    output_dir = tempfile.mkdtemp(prefix="shapeplan-oracle-")
    _, config, *_ = make_parser().parse_args_and_config([
        "--output_dir", output_dir, "--report_to", "none", "--use_cpu", "true", "--save_strategy", "no",
        "--logging_steps", "1000", "--bf16", "false", "--disable_tqdm", "true",
        "--teacher_model_name_or_path", str(TINY_MODEL), *argv], return_remaining_strings=True)
    train = load_dataset("json", data_files=str(train_path), split="train")
    eval_ds = load_dataset("json", data_files=str(eval_path), split="train") if eval_path else None
    student = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=train,
                                  eval_dataset=eval_ds)
    seen: list[Forward] = []
    state: dict[str, Any] = {"in_generate": False, "cache": None, "logits_to_keep": None}

    def step() -> int:
        return trainer.state.global_step + (1 if student.training else 0)

    generate = student.generate

    def recording_generate(*args: Any, **kwargs: Any) -> Any:
        state["in_generate"], state["cache"] = True, None
        try:
            return generate(*args, **kwargs)
        finally:
            state["in_generate"] = False

    student.generate = recording_generate

    hidden = trainer._get_last_hidden_state

    def recording_hidden(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, **kwargs: Any) -> Any:
        state["logits_to_keep"] = logits_to_keep
        try:
            return hidden(model, input_ids, attention_mask, logits_to_keep, **kwargs)
        finally:
            state["logits_to_keep"] = None

    trainer._get_last_hidden_state = recording_hidden

    def generate_hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if not state["in_generate"]:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache")
        if state["cache"] is not None and cache is state["cache"]:
            return  # a decode step of the same call
        state["cache"] = cache
        static = isinstance(cache, StaticCache)
        seen.append(Forward("generate" if module.training else "eval_generate", int(ids.shape[0]),
                            int(ids.shape[1]), step(), cache_len=cache.get_max_length() if static else None))

    def backbone_hook(phase: str, eval_phase: str) -> Any:
        def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            if state["in_generate"]:
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            keep = state["logits_to_keep"]
            assert keep is not None and kwargs.get("logits_to_keep") == keep + 1, "backbone called outside the helper"
            assert torch.is_grad_enabled() == (phase == "train" and student.training)
            seen.append(Forward(phase if student.training else eval_phase, int(ids.shape[0]), int(ids.shape[1]),
                                step(), logits_to_keep=keep))
        return hook

    student.register_forward_pre_hook(generate_hook, with_kwargs=True)
    student.base_model.register_forward_pre_hook(backbone_hook("train", "eval"), with_kwargs=True)
    teacher.base_model.register_forward_pre_hook(backbone_hook("teacher", "eval_teacher"), with_kwargs=True)
    # The tiny model's decode steps are too small to share between threads: one thread runs them 3x faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    return seen
