"""Real `trl sft` runs and warm-ups on the tiny model, with what they dispatch or compile recorded."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shapeplan.analyze import analyze
from shapeplan.plan.model import Plan
from shapeplan.warm.backends.inductor import InductorBackend
from shapeplan.warm.cachedir import check_cache_dir
from shapeplan.warm.model import WarmReport
from shapeplan.warm.opsig import OpRecorder, Signature, outside_data_loading
from shapeplan.warm.runner import warm
from shapeplan.warm.sft import SFTWarmer
from tests.conftest import TINY_MODEL

# Every run here: the tiny model, no checkpoints, fp32 on CPU (bf16 autocast on CPU is slow and changes nothing
# about which ops run where).
BASE = ["--model_name_or_path", str(TINY_MODEL), "--bf16", "false", "--save_strategy", "no", "--report_to", "none",
        "--use_cpu", "true", "--disable_tqdm", "true"]


def run_argv(data: Path, argv: Sequence[str], output_dir: Path) -> list[str]:
    return ["--dataset_name", str(data), *BASE, "--output_dir", str(output_dir), *argv]


def plan_for(data: Path, argv: Sequence[str], output_dir: Path) -> Plan:
    return analyze("sft", run_argv(data, argv, output_dir))


def real_run(data: Path, argv: Sequence[str], output_dir: Path, callbacks: Sequence[object] = ()) -> None:
    """`trl sft ARGV`: TRL's parser, and the trainer built and trained as `trl.scripts.sft.main` does (only the
    dataset is read from a local file, and the final save is left out)."""
    from datasets import load_dataset
    from trl import SFTTrainer, get_peft_config, get_quantization_config
    from trl.scripts.sft import make_parser

    script_args, training_args, model_args, _ = make_parser().parse_args_and_config(
        ["--pad_to_multiple_of", "128", *run_argv(data, argv, output_dir)])
    training_args.model_init_kwargs = dict(
        revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    dataset = load_dataset("json", data_files={"train": str(data)}, streaming=script_args.dataset_streaming)
    trainer = SFTTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        callbacks=list(callbacks) or None,
    )
    trainer.train()


def warm_plan(plan: Plan, cache_dir: Path, *, verify: bool = False) -> WarmReport:
    from shapeplan.adapters.trl_args import parse_training_args

    backend = InductorBackend("cpu")
    cache_dir = check_cache_dir(cache_dir)
    backend.prepare(cache_dir)
    args = parse_training_args("sft", plan.config["argv"])
    warmer = SFTWarmer(args)
    return warm(plan, warmer, backend, cache_dir, verify=verify)


def record(fn, *args) -> tuple[set[Signature], Any]:  # type: ignore[no-untyped-def]
    """The op signatures `fn(*args)` dispatches outside data loading (sampler, collator, device copy), and what
    it returned."""
    recorder = OpRecorder()
    with outside_data_loading(recorder), recorder:
        result = fn(*args)
    return recorder.signatures, result
