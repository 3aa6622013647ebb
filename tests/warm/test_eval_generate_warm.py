"""GRPO, RLOO and Distillation with `--eval_strategy steps`: the warm-up runs the Trainer's own eval loop, whose batches
generate with the model's static-cache `generate` in eval mode (`eval_generate`) and compute the eval loss on
(B, P + C), once per planned eval generate size; a real run after it dispatches no device op the warm-up did not
(host work left out, tests/warm/placement.py).

Covers: GRPO/RLOO eval generation batches of 4 rows (2 prompts x 2 generations) over two prompt buckets, decoded to the
full max_completion_length, TRL's post-processing of every generated length, the eval forward of each completion
bucket, and as many eval batches as a real eval pass (the loop concatenates their losses batch by batch, and cuts the
last batch's to the eval set's rows modulo the batch size). Distillation: eval batches of 2 prompts and a short last
one of 1, each running the student's `eval` and the teacher's `eval_teacher` forwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TLDR
from tests.warm.grpo_harness import device_ops, plan_for, real_run, warm_ops
from tests.warm.test_distillation_opsig import _warm

pytestmark = pytest.mark.slow

ARGV = ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--num_generations", "2",
        "--max_completion_length", "8", "--pad_to_multiple_of", "64", "--max_steps", "2", "--bf16", "false",
        "--eval_strategy", "steps", "--eval_steps", "2", "--dataset_test_split", "train"]


def _rows(path: Path, rows: slice) -> Path:
    path.write_text("\n".join(TLDR.read_text(encoding="utf-8").splitlines()[rows]) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_eval_generate_warm_covers_every_device_op_of_the_real_run(method: str, tmp_path: Path) -> None:
    data = _rows(tmp_path / "train.jsonl", slice(0, 6))
    plan = plan_for(method, data, ARGV, tmp_path / "out")
    eval_generate = {(s.batch, s.seq) for s in plan.by_phase("eval_generate")}
    assert len({p for _, p in eval_generate}) >= 2 and plan.by_phase("eval"), plan.shapes
    report, ops = warm_ops(plan, tmp_path / "cache")
    assert not report.failed, [r.error for r in report.failed]
    assert {(r.task.batch, r.task.seq) for r in report.results if r.task.phase == "eval_generate"} == eval_generate
    real = device_ops(real_run, method, data, ARGV, tmp_path / "out")
    missing = real - ops
    assert missing == set(), sorted(map(str, missing))[:20]


DISTILLATION_ARGV = ["--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
                     "--max_completion_length", "8", "--pad_to_multiple_of", "64", "--max_steps", "2", "--bf16",
                     "false", "--eval_strategy", "steps", "--eval_steps", "2", "--dataset_test_split", "train"]


def test_distillation_eval_generate_warm_covers_every_device_op_of_the_real_run(tmp_path: Path) -> None:
    data = _rows(tmp_path / "train.jsonl", slice(0, 5))
    plan = plan_for("distillation", data, DISTILLATION_ARGV, tmp_path / "out")
    assert {s.batch for s in plan.by_phase("eval_generate")} == {2, 1} and plan.by_phase("eval_teacher")
    warmed = device_ops(_warm, plan, tmp_path / "cache")
    missing = device_ops(real_run, "distillation", data, DISTILLATION_ARGV, tmp_path / "out") - warmed
    assert missing == set(), sorted(map(str, missing))[:20]
