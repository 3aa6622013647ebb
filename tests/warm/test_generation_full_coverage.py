"""GRPO/RLOO/Distillation at 100% device-op coverage on issue 14's config: batch 8, 4 generations, 32 new tokens, a
static cache, bf16, one reward function (Distillation: the same without generations and rewards), and prompts long
enough to meet prompt buckets from 512 to 896 (completion bucket 128).

Covers: every device-op signature the real run dispatches (the loss's and metrics' masked sums over the (8, C)
completion mask, the prefill and decode of each prompt bucket, the old-logprob / reference forwards of RLOO, the
teacher forward of Distillation) is dispatched by the warm-up of its plan; host work is left out
(tests/warm/placement.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TLDR
from tests.warm.grpo_harness import device_ops, plan_for, real_run, warm_plan
from tests.warm.test_distillation_opsig import _warm

pytestmark = pytest.mark.slow

ISSUE_CONFIG = ["--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "32",
                "--pad_to_multiple_of", "128", "--max_steps", "6", "--bf16", "true"]


def _long_prompts(path: Path, rows: int) -> Path:
    """TLDR rows whose prompts are two or three sample prompts joined: 500 to 1000 tokens for the tiny tokenizer."""
    sample = [json.loads(line) for line in TLDR.read_text(encoding="utf-8").splitlines()]
    out = []
    for i in range(rows):
        parts = [sample[i], sample[(i + 7) % len(sample)]] + ([sample[(i + 13) % len(sample)]] if i % 2 else [])
        out.append(json.dumps({**sample[i], "prompt": " ".join(p["prompt"] for p in parts)}))
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_issue_config_warm_covers_every_device_op(method: str, tmp_path: Path) -> None:
    data = _long_prompts(tmp_path / "train.jsonl", 32)
    plan = plan_for(method, data, ISSUE_CONFIG, tmp_path / "out")
    prompt_buckets = {s.seq for s in plan.shapes if s.phase == "generate"}
    assert len(prompt_buckets) >= 3 and min(prompt_buckets) >= 512, prompt_buckets  # the config meets long buckets
    real = device_ops(real_run, method, data, ISSUE_CONFIG, tmp_path / "out")

    def warmed() -> None:
        report = warm_plan(plan, tmp_path / "cache")
        assert report.results and not report.failed, [r.error for r in report.failed]

    missing = real - device_ops(warmed)
    assert missing == set(), sorted(map(str, missing))[:20]


def test_issue_config_distillation_warm_covers_every_device_op(tmp_path: Path) -> None:
    argv = [*ISSUE_CONFIG[:2], *ISSUE_CONFIG[4:]]  # Distillation has no --num_generations
    data = _long_prompts(tmp_path / "train.jsonl", 32)
    plan = plan_for("distillation", data, argv, tmp_path / "out")
    assert min(s.seq for s in plan.shapes if s.phase == "generate") >= 512
    real = device_ops(real_run, "distillation", data, argv, tmp_path / "out")
    missing = real - device_ops(_warm, plan, tmp_path / "cache")
    assert missing == set(), sorted(map(str, missing))[:20]
