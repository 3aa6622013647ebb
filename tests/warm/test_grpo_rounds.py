"""What the GRPO/RLOO warm-up runs for a plan, worked out by hand: tasks, prompt layouts and rounds."""

from __future__ import annotations

import pytest

from shapeplan.errors import PlanFileError
from shapeplan.plan.model import Plan, PlanStats, Shape
from shapeplan.warm.rounds import (
    Call,
    GenerateTask,
    Round,
    completion_length,
    generation_tasks,
    prompt_layouts,
    task_rounds,
)


def _plan(*shapes: Shape) -> Plan:
    return Plan(method="grpo", exact=True, pad_to_multiple_of=8, shapes=shapes,
                stats=PlanStats(rows=8, dropped_rows=0, micro_batches=4, optimizer_steps=4, tokens=0, padded_tokens=0),
                config={}, versions={}, fingerprint={}, warnings=())


def _generate(seq: int, cache: int) -> Shape:
    return Shape("generate", 2, seq, 1, 1, cache_len=cache, max_new_tokens=12)


def _forward(phase: str, prompt: int, completion: int) -> Shape:
    return Shape(phase, 2, prompt + completion, 1, 1, certain=False, logits_to_keep=completion)


def test_one_task_per_generate_size_with_the_completion_buckets_of_its_prompt_bucket() -> None:
    plan = _plan(*[_forward(phase, p, c) for phase in ("train", "old_logprob", "ref") for p in (168, 352)
                   for c in (8, 16)], _generate(352, 363), _generate(168, 363), _generate(168, 400))
    assert generation_tasks(plan) == (
        GenerateTask("generate", 2, 352, 363, 12, (8, 16)),
        GenerateTask("generate", 2, 168, 363, 12, (8, 16)),
        GenerateTask("generate", 2, 168, 400, 12, ()),  # its forwards are the same as the task before
    )


def test_eval_side_generation_is_a_task_and_a_foreign_phase_is_refused() -> None:
    eval_forward = Shape("eval", 2, 176, 1, 0, logits_to_keep=8)
    plan = _plan(_generate(168, 363), Shape("eval_generate", 2, 168, 1, 0, cache_len=363, max_new_tokens=12),
                 eval_forward)
    assert generation_tasks(plan) == (GenerateTask("generate", 2, 168, 363, 12, ()),
                                      GenerateTask("eval_generate", 2, 168, 363, 12, (8,)))
    # every eval generate uncertain (training's tool turns may have grown the cache): the batch's own calls are
    # rounds, which run the eval forwards; a call of fewer rows, or at a prompt no forward starts at, is a turn
    uncertain = [Shape("eval_generate", rows, seq, 1, 0, cache_len=400, max_new_tokens=12, certain=False)
                 for rows, seq in ((2, 168), (1, 168), (2, 256))]
    assert [(t.batch, t.seq, t.completions, t.turn) for t in generation_tasks(
        _plan(_generate(168, 363), *uncertain, eval_forward))][1:] == [(2, 168, (8,), False), (1, 168, (), True),
                                                                       (2, 256, (), True)]
    foreign = _plan(_generate(168, 363), Shape("kl", 2, 168, 1, 0))
    with pytest.raises(PlanFileError, match="the plan has kl shapes, which a grpo run does not meet"):
        generation_tasks(foreign)


def test_prompt_layouts() -> None:
    assert prompt_layouts(4, 2, 8) == (False,)  # two prompts: padded
    assert prompt_layouts(2, 2, 8) == (False, True)  # one prompt: padded unless its length is a multiple of 8
    assert prompt_layouts(2, 2, 1) == (True,)
    assert prompt_layouts(2, 2, None) == (True,)


def test_completion_length_reaches_each_bucket() -> None:
    assert completion_length(8, 12, 8) == 8
    assert completion_length(16, 12, 8) == 12
    with pytest.raises(PlanFileError):
        completion_length(24, 12, 8)


def test_rounds_of_a_task() -> None:
    task = GenerateTask("generate", 2, 168, 363, 12, (8, 16))
    before = tuple([Call(2, 168, length, 2) for length in range(1, 12)] + [Call(2, 168, 12, k) for k in (0, 1, 2)])
    assert task_rounds(task, 8) == [
        Round(task, Call(2, 168, cache_len=363), before),  # the model's own generate, then every length's EOS search
        Round(task, Call(2, 168, 8, 2)),  # C=8: 8 tokens, every row ends in EOS (generation stopped early)
        Round(task, Call(2, 168, 12, 0), last=True),  # C=16: all 12 tokens, no EOS
    ]
    rounds = task_rounds(task, 8, (False, True))
    assert [r.own for r in rounds] == [
        Call(2, 168, cache_len=363), Call(2, 168, unpadded=True, cache_len=363),
        Call(2, 168, 8, 2), Call(2, 168, 8, 2, unpadded=True), Call(2, 168, 8, 2, unpadded=True, short=True),
        Call(2, 168, 12, 0), Call(2, 168, 12, 0, unpadded=True), Call(2, 168, 12, 0, unpadded=True, short=True),
    ]
    assert [bool(r.before) for r in rounds] == [True] + [False] * 7
    assert [r.last for r in rounds] == [False] * 7 + [True]
    # a rollout function joins several calls' tokens: a bucket past one call's 12 tokens is returned whole
    rollout = GenerateTask("generate", 2, 168, 363, 12, (16, 24))
    assert [r.own for r in task_rounds(rollout, 8, rollout=True)[1:]] == [Call(2, 168, 12, 0), Call(2, 168, 24, 0)]
    with pytest.raises(PlanFileError):
        task_rounds(rollout, 8)
