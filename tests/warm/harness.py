"""Real `trl <method>` runs and warm-ups on the tiny model, with what they dispatch or compile recorded.

The harness API, the same in tests/warm/grpo_harness.py (the generation trainers, with their reward options):
`plan_for(method, data, argv, output_dir)`, `real_run(method, data, argv, output_dir)`,
`warm_plan(plan, cache_dir, *, verify=False)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from shapeplan.plan.model import Plan
from shapeplan.services.analyze import analyze
from shapeplan.services.trainers import TRAINERS
from shapeplan.warm.backends.inductor import InductorBackend
from shapeplan.warm.cachedir import check_cache_dir
from shapeplan.warm.model import WarmReport
from shapeplan.warm.opsig import OpRecorder, Signature, outside_data_loading
from shapeplan.warm.runner import warm
from tests.conftest import TINY_MODEL

T = TypeVar("T")

# Every run here: the tiny model, no checkpoints, fp32 on CPU (bf16 autocast on CPU is slow and changes nothing
# about which ops run where).
BASE = ["--model_name_or_path", str(TINY_MODEL), "--bf16", "false", "--save_strategy", "no", "--report_to", "none",
        "--use_cpu", "true", "--disable_tqdm", "true"]
# A LoRA run as most users train: `trl <method> --use_peft` on every linear layer (docs/peft.md).
LORA = ["--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear"]


def run_argv(data: Path, argv: Sequence[str], output_dir: Path) -> list[str]:
    return ["--dataset_name", str(data), *BASE, "--output_dir", str(output_dir), *argv]


def plan_for(method: str, data: Path, argv: Sequence[str], output_dir: Path) -> Plan:
    return analyze(method, run_argv(data, argv, output_dir))


def real_run(method: str, data: Path, argv: Sequence[str], output_dir: Path,
             callbacks: Sequence[object] = ()) -> None:
    """`trl <method> ARGV`: TRL's parser, and the trainer built and trained as `trl.scripts.<method>.main` does
    (only the dataset is read from a local file, and the final save is left out)."""
    import trl
    from datasets import load_dataset

    parser = importlib.import_module(TRAINERS[method].script).make_parser()
    script_args, training_args, model_args, *_ = parser.parse_args_and_config(
        ["--pad_to_multiple_of", "128", *run_argv(data, argv, output_dir)])
    model_init_kwargs = dict(
        revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    dataset = load_dataset("json", data_files={"train": str(data)}, streaming=script_args.dataset_streaming)
    trainer = TRAINERS[method].trainer()(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=trl.get_quantization_config(model_args),
        peft_config=trl.get_peft_config(model_args),
        callbacks=list(callbacks) or None,
    )
    trainer.train()


def warm_plan(plan: Plan, cache_dir: Path, *, verify: bool = False) -> WarmReport:
    """Warm `plan` with its method's warmer on CPU Inductor, as `shapeplan warm --device cpu` does."""
    from shapeplan.adapters.trl_args import parse_training_args

    backend = InductorBackend("cpu")
    cache_dir = check_cache_dir(cache_dir)
    backend.prepare(cache_dir)
    warmer = TRAINERS[plan.method].warmer(parse_training_args(TRAINERS[plan.method], plan.config["argv"]))
    return warm(plan, warmer, backend, cache_dir, verify=verify)


def record(fn: Callable[..., T], *args: Any) -> tuple[set[Signature], T]:
    """The op signatures `fn(*args)` dispatches outside data loading (sampler, collator, device copy), and what
    it returned."""
    recorder = OpRecorder()
    with outside_data_loading(recorder), recorder:
        result = fn(*args)
    return recorder.signatures, result
