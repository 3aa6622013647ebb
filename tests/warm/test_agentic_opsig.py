"""Agentic GRPO and Distillation coverage: every device-op signature a real run with tools dispatches, its tool
loop's later `generate` calls included (forced here: a `sequence_bias` makes the tiny model call the tool every
turn), is dispatched by the warm-up of its plan, which drives each planned tool turn through the trainer's own
`_generate_single_turn`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shapeplan.warm import distillation
from shapeplan.warm.rounds import generation_tasks
from tests.conftest import CAPYBARA, TINY_MODEL
from tests.oracle import agentic_tools
from tests.warm.grpo_harness import device_ops, plan_for, real_run, warm_ops

pytestmark = pytest.mark.slow

TOOL = "tests.oracle.agentic_tools:now"


@pytest.mark.parametrize("method", ["grpo", "distillation"])
def test_warm_dispatches_every_device_op_of_a_run_that_calls_tools(method: str, tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    lines = CAPYBARA.read_text(encoding="utf-8").splitlines()[:4]
    data.write_text("".join(json.dumps({"prompt": json.loads(line)["messages"][:1]}) + "\n" for line in lines),
                    encoding="utf-8")
    call = agentic_tools.forced_call(AutoTokenizer.from_pretrained(TINY_MODEL), "now", {})
    batch = ["--num_generations", "2"] if method == "grpo" else ["--gradient_accumulation_steps", "1"]
    argv = ["--per_device_train_batch_size", "2", *batch, "--max_completion_length", "64",
            "--max_tool_calling_iterations", "1", "--pad_to_multiple_of", "64", "--max_steps", "2",
            "--bf16", "false", "--generation_kwargs", call]
    # unpadded and unpinned, as the real run below: turns of 1 and 2 rows, each at the cache length it grew
    plan = plan_for(method, data, [*argv, "--tools", TOOL, "--pad_tool_turns", "false", "--pin_cache", "false"],
                    tmp_path / "out")
    phases = (distillation.ROUND_PHASES, distillation.EVAL_ROUND_PHASES) if method == "distillation" else ()
    turns = [t for t in generation_tasks(plan, *phases) if t.turn]
    assert {t.batch for t in turns} == {1, 2}
    real = device_ops(lambda: real_run(method, data, argv, tmp_path / "out", tools=[agentic_tools.now]))
    report, warmed = warm_ops(plan, tmp_path / "cache")
    assert not [r for r in report.results if r.status == "failed"], report.results
    assert {r.task.key for r in report.results} >= {t.key for t in turns}
    missing = real - warmed
    assert missing == set(), sorted(map(str, missing))[:20]


def test_warm_dispatches_every_device_op_of_a_two_turn_rollout(tmp_path: Path) -> None:
    """A `rollout_func` that generates, replies and generates again through the trainer's `_generate_single_turn`,
    returning an env_mask: its warm-up drives each planned call and trains on the planned completion buckets with
    a mask of its own, so every device op of the real run is dispatched, in the eval loop too (whose every generate
    is uncertain: the training rollouts may have grown the cache)."""
    data = tmp_path / "train.jsonl"
    lines = CAPYBARA.read_text(encoding="utf-8").splitlines()[:4]
    data.write_text("".join(json.dumps({"prompt": json.loads(line)["messages"][:1]}) + "\n" for line in lines),
                    encoding="utf-8")
    argv = ["--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "48",
            "--pad_to_multiple_of", "64", "--max_steps", "2", "--bf16", "false", "--eval_strategy", "steps",
            "--eval_steps", "2", "--per_device_eval_batch_size", "2", "--num_generations_eval", "2",
            "--dataset_test_split", "train"]
    # unpinned, as the real run below
    plan = plan_for("grpo", data, [*argv, "--rollout_func", "tests.oracle.agentic_tools:two_turns", "--pin_cache",
                                   "false"], tmp_path / "out")
    assert not any(s.certain for s in plan.by_phase("eval_generate")) and plan.by_phase("eval")
    turns = [t for t in generation_tasks(plan) if t.turn]
    assert turns and max(c for t in generation_tasks(plan) for c in t.completions) > 64  # past one turn's 48
    real = device_ops(lambda: real_run("grpo", data, argv, tmp_path / "out", rollout_func=agentic_tools.two_turns))
    report, warmed = warm_ops(plan, tmp_path / "cache")
    assert not [r for r in report.results if r.status == "failed"], report.results
    missing = real - warmed
    assert missing == set(), sorted(map(str, missing))[:20]
