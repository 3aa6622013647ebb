"""The shape oracle for DPO, KTO and Reward: the real TRL trainer on CPU with the bundled tiny model, recording every
forward the policy and the reference model receive, by phase and step, through the guard's recorder (the phase rules,
the reference precompute pass and KTO's KL rows included, live in `shapeplan.guard.recorder`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shapeplan.guard.recorder import Forward
from tests.conftest import TINY_MODEL
from tests.oracle.harness import load_data

TRAINERS = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "reward": "RewardTrainer"}


@dataclass(frozen=True)
class Run:
    seen: list[Forward]
    train_rows: int | None  # rows of the train dataset after the trainer prepared it (None: a stream has no length)
    optimizer_steps: int


def _parse(method: str, argv: Sequence[str]) -> tuple[Any, Any]:
    """`trl <method>`'s training config and model config (PEFT options) from `argv`."""
    import importlib

    parser = importlib.import_module(f"trl.scripts.{method}").make_parser()
    _, config, model_args, *_ = parser.parse_args_and_config(list(argv), return_remaining_strings=True)
    return config, model_args


def run_preference(method: str, train_path: Path, argv: Sequence[str], *, eval_path: Path | None = None,
                   streaming: bool = False, guard: Any = None, datasets_cache: Path | None = None) -> Run:
    """Train `trl <method>`'s trainer on `argv` (TRL options), recording what each model is fed. `streaming` loads the
    data as `trl <method> --dataset_streaming` does (an IterableDataset).

    The datasets are read into `datasets_cache` (default: a new folder), where TRL also caches a
    `precompute_ref_log_probs` pass's result: a run whose cache holds it skips that pass.
    """
    import tempfile

    if datasets_cache is None:
        with tempfile.TemporaryDirectory(prefix="shapeplan-oracle-datasets-") as fresh:
            return run_preference(method, train_path, argv, eval_path=eval_path, streaming=streaming, guard=guard,
                                  datasets_cache=Path(fresh))
    import trl
    from datasets import IterableDataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    from shapeplan import ShapeGuard

    # The tiny model's ops are too small to share across threads; on a busy 2-core box threads triple the time.
    torch.set_num_threads(1)
    config, model_args = _parse(method, [
        "--output_dir", "/tmp/shapeplan-oracle", "--report_to", "none", "--use_cpu", "true",
        "--save_strategy", "no", "--logging_steps", "1000", "--bf16", "false", "--disable_tqdm", "true",
        # recomputing activations costs CPU time and never reaches the model's top-level forward the hooks watch
        "--gradient_checkpointing", "false", *argv])
    train = load_data(train_path, streaming, cache_dir=datasets_cache)
    eval_ds = load_data(eval_path, streaming, cache_dir=datasets_cache) if eval_path else None
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    if method == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(TINY_MODEL, num_labels=1, dtype="float32")
    else:
        model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype="float32")

    seen: list[Forward] = []
    guard = guard or ShapeGuard(on_unplanned="record")  # a test's own guard checks the run against a plan
    guard.on_forward = seen.append
    trainer = getattr(trl, TRAINERS[method])(model=model, args=config, train_dataset=train, eval_dataset=eval_ds,
                                             processing_class=tokenizer, callbacks=[guard],
                                             peft_config=trl.get_peft_config(model_args))
    trainer.train()
    rows = None if isinstance(trainer.train_dataset, IterableDataset) else len(trainer.train_dataset)
    return Run(seen=seen, train_rows=rows, optimizer_steps=trainer.state.global_step)
