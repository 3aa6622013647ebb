"""Agentic GRPO (`tools=`, `environment_factory=`) against the real `GRPOTrainer`: the prompts carry the tool
schemas exactly (every certain entry equals the run), and the tool loop's later `generate` calls, forced here by a
`sequence_bias` that makes the tiny model call a tool every turn, fall inside the plan's bound, cache lengths
included."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import pytest

from shapeplan import ShapeGuard
from shapeplan.adapters.user_code import name_of
from shapeplan.plan.grpo import cache_pin
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


def _word_prompts(path: Path, words: list[int]) -> Path:
    """One conversational prompt per entry, of that many words: prompts of lengths the test chooses."""
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": "hello " * n}]}) + "\n" for n in words),
                    encoding="utf-8")
    return path


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
    (tmp_path / "plain").mkdir()
    plan, seen = _plan_and_run(tmp_path / "plain", [*argv, "--pad_tool_turns", "false"],
                               tools=[agentic_tools.tickets()])
    _inside_bound(plan, seen)
    assert {key[1] for key in seen if key[0] == "generate"} > {4}
    (tmp_path / "padded").mkdir()
    padded, seen = _plan_and_run(tmp_path / "padded", argv, tools=[agentic_tools.tickets()])
    _inside_bound(padded, seen)
    assert {s.batch for s in padded.shapes if s.phase == "generate"} == {key[1] for key in seen
                                                                         if key[0] == "generate"} == {4}
    assert len(padded.shapes) <= 2 * len(seen) < len(plan.shapes)


_ROLLOUTS = {
    "two_turns": agentic_tools.two_turns,
    "three_turns": agentic_tools.three_turns,
    "model_turns": agentic_tools.model_turns,  # the model's own generate, as the trainer's path pads and sizes it
    # prompts padded to 64 (the run's multiple is 128) and 40 new tokens of its own: its cache is P + 39
    "model_turns_64_40": functools.partial(agentic_tools.model_turns, multiple=64, max_new_tokens=40),
}


@pytest.mark.parametrize("name", list(_ROLLOUTS))
def test_a_multi_turn_rollout_func_stays_inside_the_bound(name: str, tmp_path: Path) -> None:
    """A `rollout_func` that generates, appends a reply and generates again (three times: `three_turns`), through
    the trainer's own path or the model's own `generate` (`model_turns`), in training and in the eval loop: the first
    call of the first round is exact, the later ones (at buckets the completions before decide) and the train
    buckets its completions give are inside the bound, cache lengths included; padded to the run's multiple, with
    at most twice the shapes met. Through the trainer's path, the plan pins the cache (every call at one length, as
    the guard makes the run do); the model's own calls are planned unpinned."""
    argv = ["--max_completion_length", "100", "--eval_strategy", "steps", "--eval_steps", "2",
            "--per_device_eval_batch_size", "2", "--num_generations_eval", "2"]
    plan, seen = _plan_and_run(tmp_path, argv, evaluate=True, rollout_func=_ROLLOUTS[name])
    _inside_bound(plan, seen)
    calls = 3 if name == "three_turns" else 2
    for phase in ("generate", "eval_generate"):  # each later call at a bucket of its own (more on a finer grid)
        assert len({key[2] for key in seen if key[0] == phase}) >= calls, phase
    # the eval loop's first calls come after the training rounds grew the cache: only training's first is exact
    assert any(s.certain for s in plan.shapes if s.phase == "generate")
    if name == "model_turns_64_40":
        # a 64 grid (the calls' widths allow no coarser one), each call's cache its own prompt + 40 - 1
        assert {s.seq % 128 for s in plan.shapes if s.phase == "generate"} == {0, 64}
        assert {s.cache_len for s in plan.shapes if s.phase == "generate" and s.certain} == {128 + 39}
    else:
        assert len(plan.shapes) <= 2 * len(seen), (len(plan.shapes), len(seen))
    assert plan.config["rollout_func"] == name_of(_ROLLOUTS[name])
    generate_caches = {s.cache_len for s in plan.shapes if s.phase in ("generate", "eval_generate")}
    if name.startswith("model_turns"):  # the model's own generate: no pin on the trainer's config reaches it
        assert "pin_cache" not in plan.config and len(generate_caches) > 1
    else:  # pinned at the longest length a call needs (the default; the guard pins the run)
        assert generate_caches == {plan.config["pin_cache"]}


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
    objects = {"tools": [agentic_tools.tickets()]}
    plan = analyze("distillation", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_MODEL),
                                    "--teacher_model_name_or_path", str(TINY_MODEL), *argv], **objects)
    guard = ShapeGuard(plan, on_unplanned="record")
    seen = observed(run_distillation_trainer(train, ["--pad_to_multiple_of", "128", *argv], guard=guard, **objects))
    assert not guard.unplanned and guard.summary.endswith(", counts as planned"), guard.summary
    _inside_bound(plan, seen)
    assert len([key for key in seen if key[0] == "generate"]) > 1 and plan.config["tool_turns"] == 2
    assert {key[1] for key in seen if key[0] == "generate"} == {s.batch for s in plan.shapes
                                                                if s.phase == "generate"} == {2 * 2}  # a round


def test_a_turn_after_the_longest_row_leaves_keeps_the_cache_it_grew(tmp_path: Path) -> None:
    """#55's Distillation run, one round of four prompts (one of 50 words): turn 1 runs at a bucket past the
    round's first generate, growing the cache; the row that set it leaves on a long reply, and turn 2 runs at the
    lower bucket, at the grown cache. The plan lists that (bucket, cache) for turn 2 (it did not: the run met it
    unplanned) and the guard finds the counts as planned."""
    train = _word_prompts(tmp_path / "train.jsonl", [1, 1, 50, 1])
    argv = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "1",
            "--shuffle_dataset", "false", "--cache_implementation", "static", "--max_completion_length", "200",
            "--max_tool_calling_iterations", "2", "--generation_kwargs",
            agentic_tools.forced_call(_tokenizer(), "ticket", {}), "--pin_cache", "false"]
    plan = analyze("distillation", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_MODEL),
                                    "--teacher_model_name_or_path", str(TINY_MODEL), *argv],
                   tools=[agentic_tools.tickets()])
    guard = ShapeGuard(plan, on_unplanned="record")
    records = run_distillation_trainer(train, ["--pad_to_multiple_of", "128", *argv], guard=guard,
                                       tools=[agentic_tools.tickets()])
    assert [(r.seq, r.cache_len) for r in records if r.phase == "generate"] == [(640, 839), (768, 967), (640, 967)]
    assert not guard.unplanned and guard.summary.endswith(", counts as planned"), guard.summary
    _inside_bound(plan, observed(records))


@pytest.mark.parametrize("pinned", [False, True])
def test_prompts_and_replies_of_many_lengths_stay_inside_the_bound(pinned: bool, tmp_path: Path) -> None:
    """Rounds of prompts from 1 to 150 words, tool replies of 1, 30 and 70 words, three iterations, six rounds:
    turns rise and fall between buckets and the cache grows across rounds, and every shape and count the run met
    is inside the plan's bound. Planned as by default, the cache pinned at the longest length a call needs (the
    value the unpinned plan advises; the guard pins the run), each bucket has one cache length and the plan holds
    at most twice the shapes met; unpinned (`--pin_cache false`), the running maximum can leave every bucket at each
    cache length a turn before it grew, which the run meets only some of."""
    words = [1, 120, 10, 60, 150, 5, 90, 30, 45, 2, 75, 20]
    argv = ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_steps", "6",
            "--cache_implementation", "static", "--max_completion_length", "300", "--max_tool_calling_iterations",
            "3", "--generation_kwargs", agentic_tools.forced_call(_tokenizer(), "lookup", {"query": "x"})]
    train = _word_prompts(tmp_path / "train.jsonl", words)
    run = ["--dataset_name", str(train), "--model_name_or_path", str(TINY_MODEL), *argv]
    unpinned = analyze("grpo", [*run, "--pin_cache", "false"], tools=[agentic_tools.lookups()])
    plan = analyze("grpo", run, tools=[agentic_tools.lookups()]) if pinned else unpinned
    guard = ShapeGuard(plan, on_unplanned="record")
    seen = observed(run_generation_trainer("grpo", train, ["--pad_to_multiple_of", "128", *argv], guard=guard,
                                           tools=[agentic_tools.lookups()]))
    assert not guard.unplanned and guard.summary.endswith(", counts as planned"), guard.summary
    _inside_bound(plan, seen)
    turns = {key[2] for key in seen if key[0] == "generate"}
    assert len(turns) > 2  # turns at several buckets
    if pinned:
        pin = cache_pin(unpinned.shapes)
        assert pin is not None and plan.config["pin_cache"] == pin.max_cache_len
        assert {key[3] for key in seen if key[0] == "generate"} == {pin.max_cache_len}
        assert len(plan.shapes) <= 2 * len(seen), (len(plan.shapes), len(seen))
    else:
        assert "pin_cache" not in plan.config and len({key[3] for key in seen if key[0] == "generate"}) > 1
