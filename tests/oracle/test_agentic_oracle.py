"""Agentic GRPO (`tools=`, `environment_factory=`) against the real `GRPOTrainer`: the prompts carry the tool
schemas exactly (every certain entry equals the run), and the tool loop's later `generate` calls, forced here by a
`sequence_bias` that makes the tiny model call a tool every turn, fall inside the plan's bound, cache lengths
included."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from shapeplan import ShapeGuard
from shapeplan.services.analyze import analyze
from tests.conftest import TINY_MODEL
from tests.oracle import agentic_tools
from tests.oracle.distillation_harness import run_distillation_trainer
from tests.oracle.grpo_harness import observed, run_generation_trainer
from tests.oracle.test_grpo_oracle import _conversational_prompts

pytestmark = pytest.mark.slow

RUN = ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_steps", "3",
       "--cache_implementation", "static"]


def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MODEL)


def _plan_and_run(tmp_path: Path, argv: list[str], *, evaluate: bool = False, streaming: bool = False,
                  **objects: Any):  # type: ignore[no-untyped-def]
    """The plan, and what the real run met under a guard holding it: the guard finds nothing unplanned and the
    counts as planned (a certain entry's within its max_count). `evaluate`: an eval set of 4 prompts;
    `streaming`: the data streamed (`--dataset_streaming`)."""
    train = _conversational_prompts(tmp_path / "train.jsonl", 12)
    eval_data = _conversational_prompts(tmp_path / "eval.jsonl", 4) if evaluate else None
    plan = analyze("grpo", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_MODEL), *RUN, *argv],
                   eval_source=str(eval_data) if eval_data else None, **objects)
    guard = ShapeGuard(plan, on_unplanned="record")
    seen = run_generation_trainer("grpo", train, ["--pad_to_multiple_of", "128", *RUN, *argv], guard=guard,
                                  eval_path=eval_data, streaming=streaming, **objects)
    assert not guard.unplanned and guard.summary.endswith(", counts as planned"), guard.summary
    return plan, observed(seen)


def _inside_bound(plan: Any, seen: dict) -> None:  # type: ignore[type-arg]
    """Every shape the run met is planned; a certain one exactly, or (tool turns can add to it) at most its
    max_count; a possible one at most its count, no earlier than its first step."""
    bound = {(s.phase, s.batch, s.seq, s.cache_len, s.logits_to_keep): s for s in plan.shapes}
    for key, (count, first_step) in seen.items():
        shape = bound.get(key)
        assert shape is not None, key
        if shape.certain and shape.max_count is None:
            assert (count, first_step) == (shape.count, shape.first_step), key
        elif shape.certain:
            assert shape.count <= count <= shape.max_count, key
        else:
            assert count <= shape.count and first_step >= shape.first_step, key


def test_tool_schemas_make_every_certain_entry_exact(tmp_path: Path) -> None:
    """Tools the model never calls: the schemas lengthen every prompt (a generate and a train bucket later than
    without tools), and the run meets exactly the plan's certain entries."""
    plan, seen = _plan_and_run(tmp_path, ["--max_completion_length", "64"], tools=[agentic_tools.get_weather])
    plain = analyze("grpo", ["--dataset_name", str(tmp_path / "train.jsonl"), "--model_name_or_path",
                             str(TINY_MODEL), *RUN, "--max_completion_length", "64"], use_cache=False)
    certain = {(s.phase, s.batch, s.seq, s.cache_len, s.logits_to_keep): (s.count, s.first_step)
               for s in plan.shapes if s.certain}
    assert certain == seen
    assert max(s.seq for s in plan.shapes if s.phase == "train") > max(s.seq for s in plain.shapes
                                                                       if s.phase == "train")
    assert any(not s.certain or s.max_count for s in plan.shapes if s.phase == "generate")
    assert plan.config["tools"] == ["get_weather"]


@pytest.mark.parametrize("name", ["tool", "environment", "environment-stream", "eval"])
def test_forced_tool_calls_stay_inside_the_bound(name: str, tmp_path: Path) -> None:
    """Every turn calls a tool (two iterations): the later generate calls, their growing cache lengths and the
    longer completions' train buckets are all inside the plan's bound; in the eval loop too (`eval`), and with the
    environments' prompts read from a stream. Planned padded (the default with tools; the guard pads the run), the
    plan holds at most twice the shapes the run met."""
    tokenizer = _tokenizer()
    if name.startswith("environment"):
        objects: dict[str, Any] = {"environment_factory": agentic_tools.Calculator}
        call = agentic_tools.forced_call(tokenizer, "add", {"a": 1, "b": 2})
    else:
        objects = {"tools": [agentic_tools.get_weather]}
        call = agentic_tools.forced_call(tokenizer, "get_weather", {"city": "Paris"})
    evaluate = ["--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "2",
                "--num_generations_eval", "2"] if name == "eval" else []
    streaming = ["--dataset_streaming", "true"] if name.endswith("stream") else []
    plan, seen = _plan_and_run(tmp_path, ["--max_completion_length", "200", "--max_tool_calling_iterations", "2",
                                          "--generation_kwargs", call, *evaluate, *streaming],
                               evaluate=bool(evaluate), streaming=bool(streaming), **objects)
    _inside_bound(plan, seen)
    assert plan.config["pad_tool_turns"] is True and len(plan.shapes) <= 2 * len(seen), (len(plan.shapes), seen)
    phase = "eval_generate" if evaluate else "generate"
    turns = [key for key in seen if key[0] == phase]
    assert len(turns) > 1  # the tool loop generated again, at more than one (bucket, cache length)
    assert plan.config["tool_turns"] == 2


def test_padded_tool_turns_generate_on_the_rounds_rows(tmp_path: Path) -> None:
    """Every other tool response is too long to go on with, so a turn generates on some of the round's 4 rows:
    planned with --pad_tool_turns false, the run meets turns of fewer rows, inside the bound of 1..4; planned padded
    (the default; the guard pads the run as the plan says), every turn is on 4 rows, the plan lists no other batch,
    and it holds at most twice the shapes the run met."""
    argv = ["--max_completion_length", "200", "--max_tool_calling_iterations", "2",
            "--generation_kwargs", agentic_tools.forced_call(_tokenizer(), "ticket", {})]
    objects = {"tools": [agentic_tools.ticket]}
    (tmp_path / "plain").mkdir()
    plan, seen = _plan_and_run(tmp_path / "plain", [*argv, "--pad_tool_turns", "false"], **objects)
    _inside_bound(plan, seen)
    assert {key[1] for key in seen if key[0] == "generate"} > {4}
    (tmp_path / "padded").mkdir()
    padded, seen = _plan_and_run(tmp_path / "padded", argv, **objects)
    _inside_bound(padded, seen)
    assert {s.batch for s in padded.shapes if s.phase == "generate"} == {key[1] for key in seen
                                                                         if key[0] == "generate"} == {4}
    assert len(padded.shapes) <= 2 * len(seen) < len(plan.shapes)


def test_a_two_turn_rollout_func_stays_inside_the_bound(tmp_path: Path) -> None:
    """A `rollout_func` that generates, appends a reply and generates again through the trainer's own path, in
    training and in the eval loop: the first call of the first round is exact, the second (at a bucket the first
    completion decides) and the train buckets its completions give are inside the bound, cache lengths included,
    with at most twice the shapes met."""
    argv = ["--max_completion_length", "100", "--eval_strategy", "steps", "--eval_steps", "2",
            "--per_device_eval_batch_size", "2", "--num_generations_eval", "2"]
    plan, seen = _plan_and_run(tmp_path, argv, evaluate=True, rollout_func=agentic_tools.two_turns)
    _inside_bound(plan, seen)
    for phase in ("generate", "eval_generate"):
        assert len({key[2] for key in seen if key[0] == phase}) == 2, phase
    # the eval loop's first calls come after the training rounds grew the cache: only training's first is exact
    assert any(s.certain for s in plan.shapes if s.phase == "generate")
    assert len(plan.shapes) <= 2 * len(seen)
    assert plan.config["rollout_func"] == f"{agentic_tools.__name__}:two_turns"


def test_the_guard_names_the_tool_turn_of_an_unplanned_generate(tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    """A plan without the tool turns' bound: each generate the tool loop makes is reported unplanned, naming its
    turn; the rounds' first generate calls are planned (the cache is pinned, so a turn does not grow it)."""
    train = _conversational_prompts(tmp_path / "train.jsonl", 12)
    generation = {**json.loads(agentic_tools.forced_call(_tokenizer(), "now", {})), "max_cache_len": 1024}
    argv = [*RUN, "--max_completion_length", "64", "--max_tool_calling_iterations", "1",
            "--generation_kwargs", json.dumps(generation)]
    objects = {"tools": [agentic_tools.now]}
    plan = analyze("grpo", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_MODEL), *argv], **objects)
    first_turns = dataclasses.replace(plan, shapes=tuple(s for s in plan.shapes if s.certain))
    guard = ShapeGuard(first_turns, on_unplanned="warn")
    run_generation_trainer("grpo", train, ["--pad_to_multiple_of", "128", *argv], guard=guard, **objects)
    assert guard.unplanned and {(f.phase, f.turn) for f in guard.unplanned.values()} == {("generate", 1)}
    lines = [line for line in capfd.readouterr().err.splitlines() if "unplanned shape" in line]
    assert lines and all(" in tool turn 1 at step " in line for line in lines), lines


def test_distillation_tool_calls_stay_inside_the_bound(tmp_path: Path) -> None:
    """DistillationTrainer's tool loop is GRPO's: the student calls a tool every turn, half the rows leave the loop
    on a long response, and every shape the run met, the teacher's forwards included, is inside the plan's bound;
    planned with --pad_tool_turns, which the guard applies, every turn is on the round's rows."""
    train = _conversational_prompts(tmp_path / "train.jsonl", 8)
    argv = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "2",
            "--cache_implementation", "static", "--max_completion_length", "200", "--max_tool_calling_iterations",
            "2", "--generation_kwargs", agentic_tools.forced_call(_tokenizer(), "ticket", {}), "--pad_tool_turns",
            "true"]
    objects = {"tools": [agentic_tools.ticket]}
    plan = analyze("distillation", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_MODEL),
                                    "--teacher_model_name_or_path", str(TINY_MODEL), *argv], **objects)
    guard = ShapeGuard(plan, on_unplanned="record")
    seen = observed(run_distillation_trainer(train, ["--pad_to_multiple_of", "128", *argv], guard=guard, **objects))
    assert not guard.unplanned and guard.summary.endswith(", counts as planned"), guard.summary
    _inside_bound(plan, seen)
    assert len([key for key in seen if key[0] == "generate"]) > 1 and plan.config["tool_turns"] == 2
    assert {key[1] for key in seen if key[0] == "generate"} == {s.batch for s in plan.shapes
                                                                if s.phase == "generate"} == {2 * 2}  # a round
