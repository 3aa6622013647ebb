"""Tools and an environment for agentic GRPO runs, importable as `tests.oracle.agentic_tools:NAME` (the form
`--tools` and `--environment_factory` take), and a generation option that makes the tiny random model call one."""

from __future__ import annotations

import itertools
import json
from typing import Any


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name.
    """
    return f"sunny in {city}"


def now() -> str:
    """Get the current time."""
    return "noon"


class Calculator:
    """An environment: `reset` before each rollout, its public methods are the tools."""

    def reset(self, **row: Any) -> str:
        return " Use the calculator."

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b


def forced_call(tokenizer: Any, name: str, arguments: dict[str, Any]) -> str:
    """`--generation_kwargs` JSON whose `sequence_bias` makes any model write one call of `name` (the Qwen3
    template's `<tool_call>` form) and end its turn: each prefix of the call biased more than the one before it, so
    the longest matched prefix wins the next token."""
    call = f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>{tokenizer.eos_token}"
    ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    return json.dumps({"sequence_bias": [[ids[:i + 1], 10.0 * (i + 1)] for i in range(len(ids))]})


_tickets = itertools.count()


def ticket() -> str:
    """Open a support ticket."""
    # every other call answers at length: those rows leave the tool loop (past max_completion_length), so a turn
    # generates on some of the round's rows
    return "opened" if next(_tickets) % 2 == 0 else "queued " * 100


def two_turns(prompts: list[Any], trainer: Any) -> dict[str, Any]:
    """A two-turn `rollout_func` through the trainer's own generation: the model answers, the environment replies
    (masked out of the loss by `env_mask`), the model answers again."""
    tokenizer = trainer.processing_class
    prompt_ids = [tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
                  for prompt in prompts]
    first, _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    reply = tokenizer("\nuser: again\nassistant:", add_special_tokens=False)["input_ids"]
    second, _ = trainer._generate_single_turn([p + c + reply for p, c in zip(prompt_ids, first, strict=True)],
                                              None, {}, 1)
    return {"prompt_ids": prompt_ids,
            "completion_ids": [c + reply + s for c, s in zip(first, second, strict=True)],
            "logprobs": None,
            "env_mask": [[1] * len(c) + [0] * len(reply) + [1] * len(s) for c, s in zip(first, second, strict=True)]}
