"""A GRPO `rollout_func`, run on each batch of prompts the run will hand it, to see its shapes.

`GRPOTrainer._generate` hands the function a round's prompts and the trainer, and takes back `prompt_ids`,
`completion_ids` and `logprobs`, which it pads as its own (left and right, to the padding multiple). The `generate`
calls are the function's: through the trainer's own generation path (`trainer._generate_single_turn`), or the
model's `generate` itself (`trainer.model_wrapped`, `trainer.model`, the unwrapped model), as a multi-turn rollout
is written where vLLM is not available. The function is run twice per batch, on the planning trainer, with every call
answered at once for every row: once with the shortest completion (EOS at once) and once with the longest (all the
new tokens the call asks for, no EOS). Each call's prompt lengths between the two runs, and the returned completion
lengths, bound what the run can meet, for a function whose later prompts and returned completions grow with what the
model writes (as appending does) and whose calls do not depend on it: two runs that differ in their calls are
refused, naming what differs.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from ..errors import UsageError
from ..plan.grpo import OwnGenerate, Rollout, RolloutCall
from .generation import generation_kwargs, static_cache
from .user_code import name_of, user_code

_HOW = ("shapeplan plans a rollout_func that generates through trainer._generate_single_turn or the trainer's model's "
        "own generate, makes the same calls whatever the model writes, and returns prompt_ids, completion_ids and "
        "logprobs")


@dataclass(frozen=True)
class _Call:
    rows: int
    width: int  # the longest prompt (the trainer's path), or the width of the padded prompts passed (the model's)
    longest_row: int  # the longest prompt's own tokens (the model's generate: by its attention mask)
    own: OwnGenerate | None  # the settings of a call of the model's generate (its multiple not yet known)


@dataclass(frozen=True)
class _Run:
    calls: tuple[_Call, ...]
    prompt: int
    completion: int


class RolloutProbe:
    """The `Rollouts` of `plan_generation`: what `func` does with a batch of a side's prompts, run once per
    distinct batch. `model_config` / `model_generation`: the run's model's config and generation config, which size
    a call of the model's own `generate` (None where they are not readable: such a call is refused)."""

    def __init__(self, func: Callable[..., Any], trainer: Any, prompts: dict[str, Sequence[Any]], *, config: Any,
                 max_new_tokens: int, model_config: Any = None, model_generation: Any = None) -> None:
        tokenizer = trainer.processing_class
        # what GRPOTrainer.__init__ sets that a rollout function reads most
        trainer.args, trainer.num_generations = config, config.num_generations
        trainer.num_generations_eval = config.num_generations_eval or config.num_generations
        trainer.max_completion_length, trainer.pad_to_multiple_of = config.max_completion_length, \
            config.pad_to_multiple_of
        trainer.generation_config, trainer.generation_kwargs = _trainer_generation(config, tokenizer)
        trainer.eos_token_ids = trainer.generation_config.eos_token_id
        self._func, self._trainer, self._prompts = func, trainer, prompts
        self._max_new_tokens = max_new_tokens
        self._eos = tokenizer.eos_token_id
        self._filler = next(i for i in tokenizer("a", add_special_tokens=False)["input_ids"]
                            if i not in tokenizer.all_special_ids)
        self._model = _DryModel(model_config, model_generation, self._eos, self._filler)
        trainer.model = trainer.model_wrapped = self._model
        self._seen: dict[tuple[str, tuple[int, ...]], Rollout] = {}

    def __call__(self, side: str, batch: Sequence[int]) -> Rollout:
        key = (side, tuple(batch))
        if key not in self._seen:
            prompts = [self._prompts[side][i] for i in batch]
            short, long = self._run(prompts, 1), self._run(prompts, None)
            runs = [short, long]
            if any(low.own is not None and low.width != high.width
                   for low, high in zip(short.calls, long.calls, strict=False)):
                # the model's own calls pad their prompts to a multiple two widths do not tell: more widths narrow it
                runs += [self._run(prompts, length) for length in
                         sorted({self._max_new_tokens * k // 8 for k in range(1, 8)} - {0, 1, self._max_new_tokens})]
            for run in runs[1:]:
                if [c.rows for c in run.calls] != [c.rows for c in short.calls]:
                    raise UsageError(f"--rollout_func makes other generate calls when the model writes more (the rows "
                                     f"of each call: {[c.rows for c in short.calls]} with the shortest completions, "
                                     f"{[c.rows for c in run.calls]} with {_longer(run is long)}): {_HOW}")
            if short.prompt != long.prompt:
                raise UsageError("--rollout_func returns other prompt_ids when the model writes more: " + _HOW)
            self._seen[key] = Rollout(
                calls=tuple(self._planned(index, [run.calls[index] for run in runs])
                            for index in range(len(short.calls))),
                prompt=short.prompt, shortest_completion=short.completion, longest_completion=long.completion)
        return self._seen[key]

    @staticmethod
    def _planned(index: int, seen: Sequence[_Call]) -> RolloutCall:
        """A call as the plan bounds it, from what it was handed with the shortest completions, the longest, and
        (a call of the model's own generate) some between."""
        name = f"--rollout_func's generate call {index + 1}"
        low, high = seen[0], seen[1]
        for other in seen[1:]:
            if other.own != low.own:
                raise UsageError(f"{name} is made another way when the model writes more ("
                                 f"{_described(low.own)} with the shortest completions, {_described(other.own)} with "
                                 f"{_longer(other is high)}): generate each call alike (the same path, max_new_tokens "
                                 "and cache), whatever the model writes")
            if not low.width <= other.width <= high.width:
                raise UsageError(f"{name} is handed shorter prompts when the model writes more ({other.width} tokens "
                                 f"with {_longer(other is high)}, {low.width} with the shortest): {_HOW}")
        if low.own is None:
            return RolloutCall(rows=low.rows, shortest=low.width, longest=high.width)
        return RolloutCall(rows=low.rows, shortest=low.width, longest=high.width,
                           own=replace(low.own, multiple=_padding(name, seen)))

    def _run(self, prompts: list[Any], length: int | None) -> _Run:
        """The function on these prompts with every completion `length` tokens, the last EOS (None: as many as a
        call asks for, no EOS)."""
        calls: list[_Call] = []
        completion = [self._filler] * self._max_new_tokens if length is None \
            else [self._filler] * (length - 1) + [self._eos]

        def generate(prompt_ids: Sequence[Sequence[int]], *args: Any, **kwargs: Any) -> tuple[list[list[int]], None]:
            width = max(len(ids) for ids in prompt_ids)
            calls.append(_Call(rows=len(prompt_ids), width=width, longest_row=width, own=None))
            return [list(completion) for _ in prompt_ids], None

        self._trainer._generate_single_turn = generate
        self._model.answer(calls, length)
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
            raise UsageError("--rollout_func made no generate call (through trainer._generate_single_turn or the "
                             "model's generate): " + _HOW)
        return _Run(calls=tuple(calls), prompt=max(map(len, prompt_ids)), completion=max(map(len, completion_ids)))


def _padding(name: str, calls: Sequence[_Call]) -> int | None:
    """The multiple a function pads the prompts it passes the model's `generate` to, as far as its calls show: a
    grid that holds every multiple m these widths and rows can come from (each width a multiple of m, less than m
    past its longest row), so the widths between them are planned whichever m it is; None: every width (prompts
    padded to their longest row)."""
    widths = [call.width for call in calls]
    if len(set(widths)) == 1:
        return None  # one width whatever the rows (padding="max_length"): one bucket
    gap = max(call.width - call.longest_row for call in calls)
    common = math.gcd(*widths)
    multiples = [d for d in range(1, math.isqrt(common) + 1) if common % d == 0]
    multiples = [m for m in {*multiples, *(common // d for d in multiples)} if m > gap]
    if gap < 0 or not multiples:
        raise UsageError(f"{name} passes the model's generate prompts {' and '.join(map(str, widths))} tokens wide "
                         f"for longest rows of {' and '.join(str(c.longest_row) for c in calls)}: shapeplan bounds "
                         "prompts padded to their longest row or to a multiple; pad them so (the tokenizer's "
                         "padding=True, pad_to_multiple_of=...)")
    step = math.gcd(*multiples)
    return None if step == 1 else step


def _longer(longest: bool) -> str:
    """Which completions a run of the dry run answered with, past the shortest."""
    return "the longest" if longest else "longer ones"


def _described(own: OwnGenerate | None) -> str:
    if own is None:
        return "through trainer._generate_single_turn"
    cache = "a static cache" + (f" pinned at {own.max_cache_len}" if own.max_cache_len is not None else "") \
        if own.static_cache else "a dynamic cache"
    return f"the model's generate with {own.max_new_tokens} new tokens and {cache}"


def _trainer_generation(config: Any, tokenizer: Any) -> tuple[Any, dict[str, Any]]:
    """The trainer's `generation_config` and `generation_kwargs`, as `GRPOTrainer.__init__` builds them for
    transformers' generate (which a rollout function may pass to the model's `generate`)."""
    from transformers import GenerationConfig

    kwargs: dict[str, Any] = {
        "max_new_tokens": config.max_completion_length, "do_sample": True, "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": [tokenizer.eos_token_id],
        "temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k, "min_p": config.min_p,
        "repetition_penalty": config.repetition_penalty, "cache_implementation": config.cache_implementation,
        **generation_kwargs(config)}
    return GenerationConfig(**kwargs, disable_compile=True), kwargs


class _DryModel:
    """The planning trainer's `model` and `model_wrapped` in the dry run (`unwrap_model` and TRL's
    `unwrap_model_for_generation` hand it back as is): its `generate` records what a call is handed and the settings
    that size its cache, as transformers merges them, and answers every row at once, with EOS or with every new token
    the call asks for. Whatever else would run the weights is refused."""

    is_gradient_checkpointing = False  # read by TRL's unwrap_model_for_generation
    training = True

    def __init__(self, config: Any, generation_config: Any, eos: int, filler: int) -> None:
        self.config, self.generation_config = config, generation_config
        self._eos, self._filler = eos, filler
        self._calls: list[_Call] = []
        self._length: int | None = 1

    def answer(self, calls: list[_Call], length: int | None) -> None:
        """Record the calls of the next run into `calls`; answer each row with `length` tokens, the last EOS (None:
        every new token the call asks for, no EOS)."""
        self._calls, self._length = calls, length

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cpu")

    def eval(self) -> _DryModel:
        return self

    def train(self, mode: bool = True) -> _DryModel:
        return self

    def generate(self, inputs: Any = None, generation_config: Any = None, **kwargs: Any) -> Any:
        import torch
        from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

        ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise UsageError("--rollout_func calls the model's generate without a 2-D tensor of input_ids "
                             "(inputs_embeds or a list): pass the padded prompt ids, as shapeplan's dry run bounds "
                             "them")
        if self.config is None:
            raise UsageError("--rollout_func calls the model's generate, whose settings come from the model's config, "
                             "which shapeplan cannot read here: pass --model_name_or_path a model folder or Hub id "
                             "whose config.json it can read, or generate through trainer._generate_single_turn")
        rows, width = ids.shape
        mask = kwargs.get("attention_mask")
        longest_row = int(mask.sum(dim=1).max()) if isinstance(mask, torch.Tensor) else width
        # transformers' own merge: the call's generation_config (else the model's), then its keyword arguments
        default_length = kwargs.get("max_length") is None and (
            generation_config is None or generation_config.max_length is None) \
            and self.generation_config.max_length is None
        merged, _ = GenerationMixin._prepare_generation_config(self, generation_config, **kwargs)  # type: ignore[arg-type]  # reads only config and generation_config
        if max(merged.num_beams or 1, merged.num_return_sequences or 1) != 1:
            raise UsageError("--rollout_func calls the model's generate with num_beams or num_return_sequences above "
                             "1, which shapeplan does not plan; generate one sequence per prompt")
        if merged.max_new_tokens is not None:
            max_length = width + merged.max_new_tokens
        elif default_length:
            max_length = min(width + merged.max_length, getattr(self.config, "max_position_embeddings", None)
                             or width + merged.max_length)
        else:
            max_length = merged.max_length
        new = max_length - width
        static = static_cache(merged)
        self._calls.append(_Call(rows=rows, width=width, longest_row=longest_row, own=OwnGenerate(
            max_new_tokens=new, static_cache=static, max_cache_len=merged.max_cache_len if static else None,
            multiple=None)))
        eos = merged.eos_token_id
        eos = (eos[0] if isinstance(eos, list) else eos) if eos is not None else self._eos
        if self._length is None:
            completion = torch.full((rows, new), self._filler)
        else:
            completion = torch.full((rows, max(0, min(self._length, new))), self._filler)
            completion[:, -1:] = eos
        sequences = torch.cat([ids, completion.to(ids.dtype).to(ids.device)], dim=1)
        if not merged.return_dict_in_generate:
            return sequences
        # one (rows, vocab) score per new token, expanded from one zero: nothing is held per token
        steps = sequences.shape[1] - width
        zeros: Any = (torch.zeros(()).expand(rows, self.config.get_text_config().vocab_size),) * steps
        return GenerateDecoderOnlyOutput(sequences=cast(Any, sequences),
                                         scores=zeros if merged.output_scores else None,
                                         logits=zeros if merged.output_logits else None)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError("--rollout_func runs the trainer's model other than through generate, which shapeplan's dry "
                         "run does not load: compute log-probabilities after the rollout (return logprobs None), and "
                         "generate through trainer._generate_single_turn or the model's generate")

    forward = __call__ = _refuse

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._refuse()


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
