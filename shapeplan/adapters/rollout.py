"""A GRPO `rollout_func`, run on each batch of prompts the run will hand it, to see its shapes.

`GRPOTrainer._generate` hands the function a round's prompts and the trainer, and takes back `prompt_ids`,
`completion_ids` and `logprobs` (grpo_trainer.py:2200-2220), which it pads as its own (left and right, to the
padding multiple). The `generate` calls the function makes are its own; shapeplan plans those made through the
trainer's own generation path, `trainer._generate_single_turn`. The function is run twice per batch, on the planning
trainer, with that path answering every row at once: once with the shortest completion (EOS at once) and once with
the longest (`max_completion_length` tokens, no EOS). Each call's prompt lengths between the two runs, and the
returned completion lengths, bound what the run can meet, for a function whose later prompts and returned
completions grow with what the model writes (as appending does) and whose calls do not depend on it: two runs
that differ in their calls are refused, naming what differs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from ..plan.grpo import Rollout, RolloutCall
from .user_code import name_of, user_code

_HOW = ("shapeplan plans a rollout_func that generates through trainer._generate_single_turn (the trainer's own "
        "path), runs its calls whatever the model writes, and returns prompt_ids, completion_ids and logprobs")


@dataclass(frozen=True)
class _Run:
    calls: tuple[tuple[int, int], ...]  # (rows, longest prompt) of each generate call
    prompt: int
    completion: int


class RolloutProbe:
    """The `Rollouts` of `plan_generation`: what `func` does with a batch of a side's prompts, run once per
    distinct batch."""

    def __init__(self, func: Callable[..., Any], trainer: Any, prompts: dict[str, Sequence[Any]], *, config: Any,
                 max_new_tokens: int) -> None:
        tokenizer = trainer.processing_class
        # what GRPOTrainer.__init__ sets that a rollout function reads most
        trainer.args, trainer.num_generations = config, config.num_generations
        trainer.num_generations_eval = config.num_generations_eval or config.num_generations
        trainer.max_completion_length, trainer.pad_to_multiple_of = config.max_completion_length, \
            config.pad_to_multiple_of
        self._func, self._trainer, self._prompts = func, trainer, prompts
        self._max_new_tokens = max_new_tokens
        self._eos = tokenizer.eos_token_id
        self._filler = next(i for i in tokenizer("a", add_special_tokens=False)["input_ids"]
                            if i not in tokenizer.all_special_ids)
        self._seen: dict[tuple[str, tuple[int, ...]], Rollout] = {}

    def __call__(self, side: str, batch: Sequence[int]) -> Rollout:
        key = (side, tuple(batch))
        if key not in self._seen:
            prompts = [self._prompts[side][i] for i in batch]
            short, long = self._run(prompts, [self._eos]), self._run(prompts, [self._filler] * self._max_new_tokens)
            if [rows for rows, _ in short.calls] != [rows for rows, _ in long.calls]:
                raise UsageError(f"--rollout_func makes other generate calls when the model writes more (the rows of "
                                 f"each call: {[rows for rows, _ in short.calls]} with the shortest completions, "
                                 f"{[rows for rows, _ in long.calls]} with the longest): {_HOW}")
            if short.prompt != long.prompt:
                raise UsageError("--rollout_func returns other prompt_ids when the model writes more: " + _HOW)
            self._seen[key] = Rollout(
                calls=tuple(RolloutCall(rows=rows, shortest=low, longest=high)
                            for (rows, low), (_, high) in zip(short.calls, long.calls, strict=True)),
                prompt=short.prompt, shortest_completion=short.completion, longest_completion=long.completion)
        return self._seen[key]

    def _run(self, prompts: list[Any], completion: list[int]) -> _Run:
        calls: list[tuple[int, int]] = []

        def generate(prompt_ids: Sequence[Sequence[int]], *args: Any, **kwargs: Any) -> tuple[list[list[int]], None]:
            calls.append((len(prompt_ids), max(len(ids) for ids in prompt_ids)))
            return [list(completion) for _ in prompt_ids], None

        self._trainer._generate_single_turn = generate
        try:
            with user_code(f"--rollout_func {name_of(self._func)}, run on a batch of prompts by shapeplan's dry "
                           "run,", _HOW):
                output = self._func(copy.deepcopy(prompts), self._trainer)
        finally:
            del self._trainer._generate_single_turn
        missing = sorted({"prompt_ids", "completion_ids", "logprobs"} - set(output if isinstance(output, dict) else ()))
        if missing:
            raise UsageError(f"--rollout_func must return keys {missing} in its output dict, as GRPOTrainer requires")
        prompt_ids = _rows(output["prompt_ids"], "prompt_ids", len(prompts))
        completion_ids = _rows(output["completion_ids"], "completion_ids", len(prompts))
        if not calls:
            raise UsageError("--rollout_func made no generate call through trainer._generate_single_turn: " + _HOW)
        return _Run(calls=tuple(calls), prompt=max(map(len, prompt_ids)), completion=max(map(len, completion_ids)))


def _rows(column: Any, key: str, prompts: int) -> list[list[int]]:
    """A returned column of token ids as GRPOTrainer takes it: one list of ids per prompt, which it turns into a
    tensor each and pads (`torch.tensor(ids)`); a tensor or array row is taken as its list."""
    if not isinstance(column, (list, tuple)):
        raise UsageError(f"--rollout_func returned {key} as a {type(column).__name__}, not a list; return one list "
                         "of token ids per prompt, as GRPOTrainer requires")
    if len(column) != prompts:
        raise UsageError(f"--rollout_func returned {len(column)} {key} for {prompts} prompts; GRPOTrainer takes one "
                         "list of token ids per prompt")
    rows = []
    for index, row in enumerate(column):
        ids = row.tolist() if hasattr(row, "tolist") else row
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                          for i in ids):
            shown = repr(row)
            raise UsageError(f"--rollout_func returned {key}[{index}] = {shown[:40]}{'...' * (len(shown) > 40)}, "
                             "not a list of token ids (whole numbers); return one list of ids per prompt, as "
                             "GRPOTrainer pads them")
        rows.append(list(ids))
    return rows
