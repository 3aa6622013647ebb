"""A streaming GRPO plan (`--dataset_streaming`) warms like any other: the warm-up runs synthetic rows of the planned
shapes, and the real streaming run after it dispatches no device op the warm-up did not (host work left out,
tests/warm/placement.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TLDR
from tests.warm.grpo_harness import device_ops, plan_for, real_run, warm_ops

pytestmark = pytest.mark.slow

# 8 prompts of two buckets of 64, shuffled by TRL's buffered shuffle, 2 generate rounds
ARGV = ["--dataset_streaming", "--per_device_train_batch_size", "2", "--num_generations", "2",
        "--max_completion_length", "8", "--pad_to_multiple_of", "64", "--max_steps", "2", "--bf16", "false"]


def test_streaming_grpo_plan_warms_every_device_op_of_the_real_run(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(TLDR.read_text(encoding="utf-8").splitlines(keepends=True)[:8]), encoding="utf-8")
    plan = plan_for("grpo", data, ARGV, tmp_path / "out")
    assert any(w.startswith("streaming: the run reads 2 train prompts") for w in plan.warnings), plan.warnings
    report, ops = warm_ops(plan, tmp_path / "cache")
    assert not report.failed, [r.error for r in report.failed]
    assert {(r.task.batch, r.task.seq) for r in report.results if r.task.phase == "generate"} == \
        {(s.batch, s.seq) for s in plan.by_phase("generate")}
    missing = device_ops(real_run, "grpo", data, ARGV, tmp_path / "out") - ops
    assert missing == set(), sorted(map(str, missing))[:20]
