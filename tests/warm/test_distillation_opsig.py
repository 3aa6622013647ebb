"""Distillation coverage: every device-op signature a real `trl distillation` run dispatches (what TorchNeuron's eager
NEFF cache is keyed on) is dispatched by the warm-up of its plan (host work left out, tests/warm/placement.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from shapeplan.adapters.trl_args import parse_training_args
from shapeplan.analyze import analyze
from shapeplan.warm.backends.inductor import InductorBackend
from shapeplan.warm.distillation import DistillationWarmer
from shapeplan.warm.runner import warm
from tests.conftest import TINY_MODEL, TLDR
from tests.warm.placement import DeviceOpRecorder, tracking

pytestmark = pytest.mark.slow

BASE = ["--model_name_or_path", str(TINY_MODEL), "--teacher_model_name_or_path", str(TINY_MODEL),
        "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true", "--disable_tqdm", "true",
        "--cache_implementation", "static"]

# name -> (TLDR rows, TRL options). Small completion lengths and padding multiples keep decode loops short.
CONFIGS = {
    # rounds of B * GA = 4 prompts over two prompt buckets, completions of up to 12 tokens in buckets of 8
    "accumulation-two-buckets": (slice(0, 12), [
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_completion_length", "12",
        "--pad_to_multiple_of", "8", "--max_steps", "3", "--bf16", "false"]),
    # bf16 weights under bf16 autocast, one prompt per micro-step, a static cache grown by a longer prompt
    "bf16-one-row": (slice(20, 28), [
        "--per_device_train_batch_size", "1", "--max_completion_length", "8", "--pad_to_multiple_of", "64",
        "--max_steps", "4", "--dtype", "bfloat16", "--bf16", "true"]),
}


def _rows(path: Path, rows: slice) -> Path:
    path.write_text("\n".join(TLDR.read_text(encoding="utf-8").splitlines()[rows]) + "\n", encoding="utf-8")
    return path


def _argv(data: Path, argv: Sequence[str], output_dir: Path) -> list[str]:
    return ["--dataset_name", str(data), *BASE, "--output_dir", str(output_dir), *argv]


def _real_run(data: Path, argv: Sequence[str], output_dir: Path) -> None:
    """`trl distillation ARGV` as its main() builds the trainer (the dataset read from a local file, no final save)."""
    import trl
    from datasets import load_dataset
    from trl.scripts.distillation import make_parser

    _, config, model_args, *_ = make_parser().parse_args_and_config(
        ["--pad_to_multiple_of", "128", *_argv(data, argv, output_dir)])
    init = dict(revision=model_args.model_revision, trust_remote_code=config.trust_remote_code,
                attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    config.model_init_kwargs = init
    config.teacher_model_init_kwargs = {**init, "revision": config.teacher_model_revision}
    trainer = trl.DistillationTrainer(model=model_args.model_name_or_path,
                                      teacher_model=config.teacher_model_name_or_path, args=config,
                                      train_dataset=load_dataset("json", data_files=str(data), split="train"),
                                      peft_config=trl.get_peft_config(model_args))
    trainer.train()


def _warm(plan, cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    backend = InductorBackend("cpu")
    cache_dir.mkdir(parents=True, exist_ok=True)
    backend.prepare(cache_dir)
    report = warm(plan, DistillationWarmer(parse_training_args(plan.method, plan.config["argv"])), backend,
                  cache_dir, verify=False)
    assert report.results and not report.failed, [r.error for r in report.failed]


def _device_ops(fn, *args):  # type: ignore[no-untyped-def]
    import importlib

    recorder = DeviceOpRecorder()
    with tracking(recorder, importlib.import_module("trl.trainer.distillation_trainer")):
        fn(*args)
    return recorder.signatures


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_warm_dispatches_every_device_op_of_the_real_run(name: str, tmp_path: Path) -> None:
    rows, argv = CONFIGS[name]
    data = _rows(tmp_path / "train.jsonl", rows)
    plan = analyze("distillation", _argv(data, argv, tmp_path / "out"))
    assert {s.phase for s in plan.shapes} == {"generate", "train", "teacher"}
    real = _device_ops(_real_run, data, argv, tmp_path / "out")
    warmed = _device_ops(_warm, plan, tmp_path / "cache")
    missing = real - warmed
    assert missing == set(), sorted(map(str, missing))[:20]


def test_cli_warms_every_generate_task_once_and_verify_passes(tmp_path: Path) -> None:
    """`shapeplan warm --method distillation` end to end: one task per planned generate size, each cached (eager CPU
    compiles nothing), recorded in the manifest; a second run skips them all and `verify` finds nothing to compile."""
    from shapeplan.plan.io import load_plan
    from tests.warm.test_parallel import _manifest_shapes, _shapeplan

    data, plan_path, cache = _rows(tmp_path / "train.jsonl", slice(0, 12)), tmp_path / "plan.json", tmp_path / "c"
    run = _argv(data, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                       "--max_completion_length", "8", "--pad_to_multiple_of", "8", "--max_steps", "2",
                       "--bf16", "false"], tmp_path / "out")[2:]  # DATASET is positional after --method
    analyzed = _shapeplan("analyze", "--method", "distillation", str(data), *run, "-o", str(plan_path))
    assert analyzed.returncode == 0, analyzed.stderr
    plan = load_plan(plan_path)
    keys = [t.key for t in DistillationWarmer(parse_training_args(plan.method, plan.config["argv"])).tasks(plan)]
    generate = [s for s in plan.shapes if s.phase == "generate"]
    assert len(keys) == len(generate) >= 2

    warmed = _shapeplan("warm", "--plan", str(plan_path), "--device", "cpu", "--cache-dir", str(cache), "--json")
    assert warmed.returncode == 0, warmed.stderr[-3000:]
    assert {r["key"]: r["status"] for r in json.loads(warmed.stdout)["results"]} == \
        {k: "cached" for k in keys}
    assert _manifest_shapes(cache) == {k: "cached" for k in keys}
    again = _shapeplan("warm", "--plan", str(plan_path), "--device", "cpu", "--cache-dir", str(cache), "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert {r["key"]: r["status"] for r in json.loads(again.stdout)["results"]} == \
        {k: "skipped" for k in keys}
    verified = _shapeplan("verify", "--plan", str(plan_path), "--device", "cpu", "--cache-dir", str(cache), "--json")
    assert verified.returncode == 0, verified.stderr[-3000:]
