"""DPO and KTO with `precompute_ref_log_probs`: the warm-up runs TRL's own precompute pass (`_precompute_ref_logps`) on
synthetic batches of the planned `ref_precompute` shapes, and a real run after it dispatches no device op the
warm-up did not (host work left out, tests/warm/placement.py).

Covers: the train pass (batch 3 over 34 rows: full batches and a short last one, whose gathered log-probs accelerate
cuts to the remainder), the eval pass (batch 16: two full and a short last one of 2 rows), KTO's KL completions in
the pass, and the train steps and the eval loop reading the precomputed log-probs from the batch instead of running the
reference model."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.warm.harness import plan_for, real_run, warm_plan
from tests.warm.placement import DeviceOpRecorder, tracking

pytestmark = pytest.mark.slow

# method -> (data, the planned ref_precompute batch sizes: sequences per batch, DPO stacking chosen and rejected)
CASES = {
    "dpo": (ROOT / "tests" / "fixtures" / "preference-explicit.jsonl", {6, 2, 32, 4}),
    "kto": (ROOT / "tests" / "fixtures" / "kto-unpaired.jsonl", {3, 1, 16, 2}),
}
ARGV = ["--per_device_train_batch_size", "3", "--max_length", "256", "--max_steps", "2",
        "--precompute_ref_log_probs", "true", "--eval_strategy", "steps", "--eval_steps", "2",
        "--per_device_eval_batch_size", "16", "--dataset_test_split", "train"]


def _device_ops(method: str, fn, *args):  # type: ignore[no-untyped-def]
    recorder = DeviceOpRecorder()
    with tracking(recorder, importlib.import_module(f"trl.trainer.{method}_trainer")):
        fn(*args)
    return recorder.signatures


@pytest.mark.parametrize("method", sorted(CASES))
def test_precompute_warm_covers_every_device_op_of_the_real_run(method: str, tmp_path: Path) -> None:
    data, batches = CASES[method]
    plan = plan_for(method, data, ARGV, tmp_path / "out")
    precompute = {(s.batch, s.seq) for s in plan.shapes if s.phase == "ref_precompute"}
    # 34 rows are left after TRL drops the fully truncated ones: full and short batches of both passes
    assert {b for b, _ in precompute} == batches
    assert not plan.by_phase("ref")  # the step reads the precomputed log-probs
    report = None

    def warmed() -> None:
        nonlocal report
        report = warm_plan(plan, tmp_path / "cache")

    ops = _device_ops(method, warmed)
    assert report is not None and not report.failed, [r.error for r in report.failed]
    assert {(r.task.batch, r.task.seq) for r in report.results if r.task.phase == "ref_precompute"} == precompute
    real = _device_ops(method, real_run, method, data, ARGV, tmp_path / "out")
    missing = real - ops
    assert missing == set(), sorted(map(str, missing))[:20]
