"""`shapeplan.pad_tool_turns` on a trainer's tool loop: what it hands `_generate_single_turn` and what it returns
(the real trainers' runs are in tests/oracle/test_agentic_oracle.py)."""

from __future__ import annotations

from typing import Any

import pytest

from shapeplan import ShapeplanError, pad_tool_turns


class _Loop:
    """A trainer's tool loop as GRPOTrainer's calls `_generate_single_turn`: once on the round, then on the rows
    that called a tool. `logprobs`: GRPO returns (ids, log-probs), Distillation the ids."""

    def __init__(self, logprobs: bool) -> None:
        self.logprobs = logprobs
        self.calls: list[list[list[int]]] = []

    def _generate_single_turn(self, prompt_ids: list[list[int]], images: Any, multimodal_fields: Any,
                              *args: Any) -> Any:
        self.calls.append(prompt_ids)
        ids = [[len(row)] for row in prompt_ids]
        return (ids, None) if self.logprobs else ids

    def _tool_call_loop(self, prompts: Any, prompt_ids: list[list[int]]) -> Any:
        return self._generate_single_turn([prompt_ids[1] + [7]], None, {}, 1)


@pytest.mark.parametrize("logprobs", [True, False])
def test_a_turn_generates_on_the_rounds_rows_and_returns_its_own(logprobs: bool) -> None:
    trainer = _Loop(logprobs)
    pad_tool_turns(trainer)
    pad_tool_turns(trainer)  # once only
    first = trainer._generate_single_turn([[1], [2, 2], [3]], None, {}, 3)  # not in a tool loop: as given
    turn = trainer._tool_call_loop(None, [[1], [2, 2], [3]])
    assert trainer.calls == [[[1], [2, 2], [3]], [[2, 2, 7]] * 3]
    expected = (([[1], [2], [1]], None), ([[3]], None)) if logprobs else ([[1], [2], [1]], [[3]])
    assert (first, turn) == expected


def test_a_trainer_without_a_tool_loop_is_refused() -> None:
    with pytest.raises(ShapeplanError, match="object has no tool loop to pad; pad_tool_turns takes a GRPOTrainer"):
        pad_tool_turns(object())


def test_the_pin_is_set_on_the_generation_config_the_trainer_has_at_each_call() -> None:
    """`pin_cache` (what a guard holding a pinned plan does): the trainer builds its generation config after its
    callbacks attach, so the pin is set at each call, on the config and the kwargs the trainer has then; a run
    that pins its cache at another length is refused."""
    from transformers import GenerationConfig

    from shapeplan.adapters.tool_turns import pin_cache

    trainer: Any = _Loop(logprobs=True)
    pin_cache(trainer, 967)  # before the trainer has a generation config, as a guard's on_init_end
    trainer.generation_config = GenerationConfig(max_new_tokens=8, cache_implementation="static")
    trainer.generation_kwargs = {"max_new_tokens": 8}
    trainer._tool_call_loop(None, [[1], [2]])
    assert trainer.generation_config.max_cache_len == 967 and trainer.generation_kwargs["max_cache_len"] == 967
    assert trainer.calls == [[[2, 7]]]  # the call went through, as given
    trainer.generation_config.max_cache_len = 1024  # the run's own pin, which the plan does not have
    with pytest.raises(ShapeplanError, match="the run pins its cache at max_cache_len 1024 and the plan at 967"):
        trainer._tool_call_loop(None, [[1], [2]])
