"""Tools and an environment for agentic GRPO runs, importable as `tests.oracle.agentic_tools:NAME` (the form
`--tools` and `--environment_factory` take), and a generation option that makes the tiny random model call one."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
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


def tickets() -> Callable[[], str]:
    """A fresh `ticket` tool: every other call answers at length (from the second on), which sends that row out of
    the tool loop (past max_completion_length), so a turn generates on some of the round's rows."""
    calls = itertools.count()

    def ticket() -> str:
        """Open a support ticket."""
        return "opened" if next(calls) % 2 == 0 else "queued " * 100

    return ticket


def lookups() -> Callable[..., str]:
    """A fresh `lookup` tool whose replies run 1, 30 and 70 words in turn."""
    calls = itertools.count()

    def lookup(query: str) -> str:
        """Look something up.

        Args:
            query: What to look up.
        """
        return "found " * (1, 30, 70)[next(calls) % 3]

    return lookup


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


def three_turns(prompts: list[Any], trainer: Any) -> dict[str, Any]:
    """A three-turn `rollout_func` through the trainer's own generation: answer, reply, answer, reply, answer."""
    tokenizer = trainer.processing_class
    prompt_ids = [tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
                  for prompt in prompts]
    reply = tokenizer("\nuser: again\nassistant:", add_special_tokens=False)["input_ids"]
    completions: list[list[int]] = [[] for _ in prompts]
    masks: list[list[int]] = [[] for _ in prompts]
    for turn in range(3):
        answers, _ = trainer._generate_single_turn([p + c for p, c in zip(prompt_ids, completions, strict=True)],
                                                   None, {}, 1)
        for completion, mask, answer in zip(completions, masks, answers, strict=True):
            told = reply if turn < 2 else []
            completion += answer + told
            mask += [1] * len(answer) + [0] * len(told)
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None, "env_mask": masks}


def model_turns(prompts: list[Any], trainer: Any, *, multiple: int | None = -1,
                max_new_tokens: int | None = None) -> dict[str, Any]:
    """A two-turn `rollout_func` that generates through the trainer's model itself, as a multi-turn rollout is
    written without vLLM: prompts padded on the left (to the trainer's multiple; `multiple`: to another, None: to the
    longest), the trainer's generation config (`max_new_tokens`: the call's own), each answer cut after its first
    EOS."""
    from trl.models import unwrap_model_for_generation

    tokenizer = trainer.processing_class
    prompt_ids = [tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
                  for prompt in prompts]
    reply = tokenizer("\nuser: again\nassistant:", add_special_tokens=False)["input_ids"]
    own = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}

    def generate(rows: list[list[int]]) -> list[list[int]]:
        batch = tokenizer.pad({"input_ids": rows}, padding=True, padding_side="left", return_tensors="pt",
                              pad_to_multiple_of=trainer.pad_to_multiple_of if multiple == -1 else multiple)
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            out = model.generate(**batch, generation_config=trainer.generation_config, **own)
        answers = out[:, batch["input_ids"].shape[1]:].tolist()
        eos = tokenizer.eos_token_id
        return [answer[:answer.index(eos) + 1] if eos in answer else answer for answer in answers]

    first = generate(prompt_ids)
    second = generate([p + c + reply for p, c in zip(prompt_ids, first, strict=True)])
    return {"prompt_ids": prompt_ids,
            "completion_ids": [c + reply + s for c, s in zip(first, second, strict=True)],
            "logprobs": None,
            "env_mask": [[1] * len(c) + [0] * len(reply) + [1] * len(s) for c, s in zip(first, second, strict=True)]}
