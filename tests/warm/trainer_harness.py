"""Real `trl dpo|reward|kto` runs and warm-ups on the tiny model (the SFT ones are in tests/warm/harness.py)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

from shapeplan.analyze import analyze
from shapeplan.plan.model import Plan
from shapeplan.trainers import TRAINERS
from shapeplan.warm.backends.inductor import InductorBackend
from shapeplan.warm.cachedir import check_cache_dir
from shapeplan.warm.model import WarmReport
from shapeplan.warm.runner import make_warmer, warm
from tests.warm.harness import run_argv


def plan_for(method: str, data: Path, argv: Sequence[str], output_dir: Path) -> Plan:
    return analyze(method, run_argv(data, argv, output_dir))


def real_run(method: str, data: Path, argv: Sequence[str], output_dir: Path) -> None:
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
    dataset = load_dataset("json", data_files={"train": str(data)})
    trainer = TRAINERS[method].trainer()(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        quantization_config=trl.get_quantization_config(model_args),
        peft_config=trl.get_peft_config(model_args),
    )
    trainer.train()


def warm_plan(method: str, plan: Plan, cache_dir: Path, *, verify: bool = False) -> WarmReport:
    from shapeplan.adapters.trl_args import parse_training_args

    backend = InductorBackend("cpu")
    cache_dir = check_cache_dir(cache_dir)
    backend.prepare(cache_dir)
    warmer = make_warmer(method, parse_training_args(method, plan.config["argv"]))
    return warm(plan, warmer, backend, cache_dir, verify=verify)
