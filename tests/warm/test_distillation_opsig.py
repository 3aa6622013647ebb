"""Distillation coverage: every device-op signature a real `trl distillation` run dispatches (what TorchNeuron's eager
NEFF cache is keyed on) is dispatched by the warm-up of its plan (host work left out, tests/warm/placement.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shapeplan.adapters.trl_args import parse_training_args
from shapeplan.services.trainers import TRAINERS
from shapeplan.warm.distillation import DistillationWarmer
from tests.conftest import TLDR
from tests.warm.grpo_harness import device_ops, plan_for, real_run, run_argv, warm_plan

pytestmark = pytest.mark.slow

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


def _warm(plan, cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    report = warm_plan(plan, cache_dir)
    assert report.results and not report.failed, [r.error for r in report.failed]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_warm_dispatches_every_device_op_of_the_real_run(name: str, tmp_path: Path) -> None:
    rows, argv = CONFIGS[name]
    data = _rows(tmp_path / "train.jsonl", rows)
    plan = plan_for("distillation", data, argv, tmp_path / "out")
    assert {s.phase for s in plan.shapes} == {"generate", "train", "teacher"}
    real = device_ops(real_run, "distillation", data, argv, tmp_path / "out")
    warmed = device_ops(_warm, plan, tmp_path / "cache")
    missing = real - warmed
    assert missing == set(), sorted(map(str, missing))[:20]


def test_cli_warms_every_generate_task_once_and_verify_passes(tmp_path: Path) -> None:
    """`shapeplan warm --method distillation` end to end: one task per planned generate size, each cached (eager CPU
    compiles nothing), recorded in the manifest; a second run skips them all and `verify` finds nothing to compile."""
    from shapeplan.plan.io import load_plan
    from tests.warm.test_parallel import _manifest_shapes, _shapeplan

    data, plan_path, cache = _rows(tmp_path / "train.jsonl", slice(0, 12)), tmp_path / "plan.json", tmp_path / "c"
    run = run_argv(data, ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                       "--max_completion_length", "8", "--pad_to_multiple_of", "8", "--max_steps", "2",
                       "--bf16", "false"], tmp_path / "out", "distillation")[2:]  # DATASET is positional after --method
    analyzed = _shapeplan("analyze", "--method", "distillation", str(data), *run, "-o", str(plan_path))
    assert analyzed.returncode == 0, analyzed.stderr
    plan = load_plan(plan_path)
    args = parse_training_args(TRAINERS[plan.method], plan.config["argv"])
    keys = [t.key for t in DistillationWarmer(args).tasks(plan)]
    generate = [s for s in plan.shapes if s.phase == "generate"]
    assert len(keys) == len(generate) >= 2

    warmed = _shapeplan("warm", "--plan", str(plan_path), "--device", "cpu", "--cache-dir", str(cache), "--json")
    assert warmed.returncode == 0, warmed.stderr[-3000:]
    assert {r["key"]: r["status"] for r in json.loads(warmed.stdout)["results"]} == \
        {k: "eager" for k in keys}
    assert _manifest_shapes(cache) == {k: "eager" for k in keys}
    again = _shapeplan("warm", "--plan", str(plan_path), "--device", "cpu", "--cache-dir", str(cache), "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert {r["key"]: r["status"] for r in json.loads(again.stdout)["results"]} == \
        {k: "skipped" for k in keys}
    verified = _shapeplan("verify", "--plan", str(plan_path), "--device", "cpu", "--cache-dir", str(cache), "--json")
    assert verified.returncode == 0, verified.stderr[-3000:]
