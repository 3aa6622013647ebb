"""GRPO/RLOO coverage: every device-op signature a real run dispatches (what TorchNeuron's eager NEFF cache is keyed
on) is dispatched by the warm-up of its plan. Host work is left out (tests/warm/placement.py); that criterion is
checked too: two real runs whose prompts differ but fall in the same buckets dispatch the same device ops."""

from __future__ import annotations

from pathlib import Path

import pytest

from shapeplan.plan.model import Plan
from shapeplan.services.report import render_plan
from shapeplan.warm.rounds import generation_tasks
from tests.conftest import TLDR
from tests.warm.grpo_harness import device_ops, plan_for, real_run, sliding_window_model, warm_plan
from tests.warm.harness import LORA

pytestmark = pytest.mark.slow

# name -> (method, TLDR rows, TRL options). Small completion lengths and padding multiples keep decode loops short.
CONFIGS = {
    "grpo-three-prompt-buckets": ("grpo", slice(0, 16), [
        "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "12",
        "--pad_to_multiple_of", "8", "--max_steps", "3", "--bf16", "false"]),
    # old log-probs (steps_per_generation 2 with gradient_accumulation 1), a reference model, bf16 weights
    # under bf16 autocast, and a static cache grown by a longer prompt.
    "grpo-old-logprob-ref-bf16": ("grpo", slice(20, 36), [
        "--per_device_train_batch_size", "2", "--num_generations", "2", "--steps_per_generation", "2",
        "--max_completion_length", "8", "--pad_to_multiple_of", "64", "--beta", "0.1", "--max_steps", "4",
        "--dtype", "bfloat16", "--bf16", "true"]),
    # LoRA: the reference forward runs the policy with its adapters disabled, and the static cache a longer prompt
    # grew is kept by the model inside the PeftModel
    "grpo-lora-ref": ("grpo", slice(20, 36), [
        "--per_device_train_batch_size", "2", "--num_generations", "2", "--steps_per_generation", "2",
        "--max_completion_length", "8", "--pad_to_multiple_of", "64", "--beta", "0.04", "--max_steps", "4",
        "--bf16", "false", *LORA]),
    # One prompt per generation batch, unpadded (multiple 1): prompts arrive without padding, and a batch of
    # full-length completions has none at all, so attention skips its mask.
    "rloo-one-prompt-unpadded": ("rloo", slice(0, 8), [
        "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "4",
        "--pad_to_multiple_of", "1", "--beta", "0", "--max_steps", "3", "--bf16", "false"]),
}


def _rows(path: Path, rows: slice) -> Path:
    path.write_text("\n".join(TLDR.read_text(encoding="utf-8").splitlines()[rows]) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_warm_dispatches_every_device_op_of_the_real_run(name: str, tmp_path: Path) -> None:
    _assert_covered(*CONFIGS[name], tmp_path)


def test_sliding_window_model_warm_covers_the_decode_graphs(tmp_path: Path) -> None:
    """A model with a sliding layer: its static cache is min(window, cache length), the full layer's the cache
    length; the plan's report and the warm-up's labels show both, and the warm-up meets the run's decode graphs."""
    model = sliding_window_model(tmp_path / "model", 48)
    method, rows, argv = CONFIGS["grpo-three-prompt-buckets"]
    plan = _assert_covered(method, rows, [*argv, "--model_name_or_path", str(model)], tmp_path)
    caches = sorted({s.cache_len for s in plan.shapes if s.phase == "generate"})
    assert caches and caches[0] > 48, caches  # the full layer's cache is longer than the window
    report = render_plan(plan)
    assert all(f"cache {c} (sliding layers 48)" in report for c in caches), report
    assert {t.label.split(" cache ")[1].split(", new ")[0] for t in generation_tasks(plan)} == \
        {f"{c}, sliding 48" for c in caches}


def _assert_covered(method: str, rows: slice, argv: list[str], tmp_path: Path) -> Plan:
    """The real run's device ops are all dispatched by the warm-up of its plan (returned)."""
    data = _rows(tmp_path / "train.jsonl", rows)
    plan = plan_for(method, data, argv, tmp_path / "out")
    real = device_ops(real_run, method, data, argv, tmp_path / "out")
    warmed = device_ops(lambda: _checked(warm_plan(plan, tmp_path / "cache")))
    missing = real - warmed
    assert missing == set(), sorted(map(str, missing))[:20]
    return plan


def _checked(report) -> None:  # type: ignore[no-untyped-def]
    assert report.results and not report.failed, [r.error for r in report.failed]


def test_runs_differing_only_in_host_work_dispatch_the_same_device_ops(tmp_path: Path) -> None:
    """Different prompts, same buckets: the device ops are equal, the host ops (per-prompt lengths) are not."""
    argv = ["--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "8",
            "--pad_to_multiple_of", "512", "--max_steps", "2", "--bf16", "false", "--shuffle_dataset", "false"]
    first, second = _rows(tmp_path / "a.jsonl", slice(0, 4)), _rows(tmp_path / "b.jsonl", slice(4, 8))
    a = plan_for("grpo", first, argv, tmp_path / "out")
    b = plan_for("grpo", second, argv, tmp_path / "out")
    assert [s.key for s in a.shapes] == [s.key for s in b.shapes]
    ops_a, all_a = device_ops(real_run, "grpo", first, argv, tmp_path / "out", everything=True)
    ops_b, all_b = device_ops(real_run, "grpo", second, argv, tmp_path / "out", everything=True)
    assert ops_a == ops_b
    assert all_a != all_b  # what differs is host work only
