"""The Distillation shape oracle: a real `DistillationTrainer` on CPU, the bundled tiny model as student and teacher,
recording every model input it makes, by phase and step, through the guard's recorder (the phase rules, the
backbones Distillation runs directly included, live in `shapeplan.guard.recorder`). Plans are checked against this,
never against the notes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shapeplan.guard.recorder import Forward
from tests.conftest import TINY_MODEL
from tests.oracle.harness import load_data


def run_distillation_trainer(train_path: Path, argv: Sequence[str], *, eval_path: Path | None = None,
                             guard: Any = None, streaming: bool = False, **objects: Any) -> list[Forward]:
    """Train with `trl distillation`'s parser on `argv` (TRL options), recording what the models are fed. `streaming`
    loads the data as `trl distillation --dataset_streaming` does (`harness.load_data`); `objects`: the trainer's
    arguments no command line passes (tools=)."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import DistillationTrainer, get_peft_config
    from trl.scripts.distillation import make_parser

    from shapeplan import ShapeGuard

    output_dir = tempfile.mkdtemp(prefix="shapeplan-oracle-")
    _, config, model_args, *_ = make_parser().parse_args_and_config([
        "--output_dir", output_dir, "--report_to", "none", "--use_cpu", "true", "--save_strategy", "no",
        "--logging_steps", "1000", "--bf16", "false", "--disable_tqdm", "true",
        "--teacher_model_name_or_path", str(TINY_MODEL), *argv], return_remaining_strings=True)
    train = load_data(train_path, streaming)
    eval_ds = load_data(eval_path, streaming) if eval_path else None
    student = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    seen: list[Forward] = []
    guard = guard or ShapeGuard(on_unplanned="record")  # a test's own guard checks the run against a plan
    guard.on_forward = seen.append
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=train,
                                  eval_dataset=eval_ds, callbacks=[guard], peft_config=get_peft_config(model_args),
                                  **objects)
    # The tiny model's decode steps are too small to share between threads: one thread runs them 3x faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    return seen
