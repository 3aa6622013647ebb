"""The SFT warmer's bookkeeping on real runs: a failing shape does not stop the others, and an eval pass left
alone (its train shapes already warmed) still runs inside a training loop."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shapeplan.plan.model import Shape
from shapeplan.warm.manifest import MANIFEST
from tests.conftest import CAPYBARA
from tests.warm.harness import plan_for, warm_plan

pytestmark = pytest.mark.slow

ARGV = ["--max_length", "256", "--per_device_train_batch_size", "2", "--max_steps", "3", "--eval_strategy", "steps",
        "--eval_steps", "3", "--per_device_eval_batch_size", "32", "--dataset_test_split", "train"]


def test_failed_shape_does_not_stop_the_others_and_eval_resumes_alone(tmp_path: Path) -> None:
    plan = plan_for("sft", CAPYBARA, ARGV, tmp_path / "out")
    assert [(s.phase, s.batch, s.seq, s.count) for s in plan.shapes] == [("train", 2, 256, 3), ("eval", 32, 256, 3)]
    broken = dataclasses.replace(plan, shapes=(Shape(phase="train", batch=2, seq=0, count=1, first_step=1),
                                               *plan.shapes))
    cache = tmp_path / "cache"

    report = warm_plan(broken, cache)
    assert [(r.task.key, r.status) for r in report.results] == [
        ("train 2x0", "failed"), ("train 2x256 unpadded", "eager"), ("eval 32x256 per_pass=3", "eager")]
    assert report.results[0].error.startswith("RuntimeError: ")

    again = warm_plan(broken, cache)  # failed shapes are tried again, the others skipped
    assert [r.status for r in again.results] == ["failed", "skipped", "skipped"]

    manifest = cache / MANIFEST
    data = json.loads(manifest.read_text())
    (section,) = data["environments"].values()
    del section["shapes"]["eval 32x256 per_pass=3"]
    manifest.write_text(json.dumps(data))
    resumed = warm_plan(plan, cache)
    assert [r.status for r in resumed.results] == ["skipped", "eager"]
