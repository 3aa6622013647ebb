"""Make a trainer's tool loop run as a plan of it has it: its turns padded to the round's rows, its static cache
pinned.

TRL's tool loop (`_tool_call_loop`, GRPOTrainer and DistillationTrainer) generates again only on the rows whose
completion called a tool: k of the round's R rows, k the model's choice. On Neuron every k is a `generate` graph of
its own, about 12 minutes to compile, so a plan has to list every k from 1 to R for each turn shape. Padded with
copies of one calling row, every turn generates on R rows: one graph per turn shape. The copies' outputs are
dropped and the calling rows' prompts are unchanged, so the padded length and the cache length are those of the k
rows; with sampling, the copies draw from the same random generator, so which tokens are sampled differs from an
unpadded run's as it does under any other batch size.
"""

from __future__ import annotations

import functools
from typing import Any

from ..errors import UsageError

_PADDED = "_shapeplan_pads_tool_turns"
_PINNED = "_shapeplan_pins_cache"


def pad_tool_turns(trainer: Any) -> None:
    """Make `trainer`'s tool loop generate on the round's rows at every turn (as `shapeplan analyze` plans a run
    with tools, unless told `--pad_tool_turns false`). Call it once, before training; a `ShapeGuard` holding such a
    plan calls it. Turns with images are left as they are (vision-language runs with tools are not planned)."""
    if getattr(trainer, _PADDED, False):
        return
    loop = getattr(trainer, "_tool_call_loop", None)
    single_turn = getattr(trainer, "_generate_single_turn", None)
    if loop is None or single_turn is None:
        raise UsageError(f"{type(trainer).__name__} has no tool loop to pad; pad_tool_turns takes a GRPOTrainer or "
                         "DistillationTrainer")
    rounds: list[int] = []  # the rows of the round whose tool loop is running

    @functools.wraps(single_turn)
    def padded_turn(prompt_ids: list[list[int]], images: Any, multimodal_fields: Any, *args: Any,
                    **kwargs: Any) -> Any:
        rows = len(prompt_ids)
        if not rounds or rows >= rounds[-1] or images is not None or multimodal_fields:
            return single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        out = single_turn([*prompt_ids, *[prompt_ids[0]] * (rounds[-1] - rows)], images, multimodal_fields, *args,
                          **kwargs)
        # GRPO returns (completion ids, log-probs or None), Distillation the completion ids
        if isinstance(out, tuple):
            return tuple(None if part is None else part[:rows] for part in out)
        return out[:rows]

    @functools.wraps(loop)
    def padded_loop(prompts: Any, prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> Any:
        rounds.append(len(prompt_ids))
        try:
            return loop(prompts, prompt_ids, *args, **kwargs)
        finally:
            rounds.pop()

    trainer._generate_single_turn = padded_turn
    trainer._tool_call_loop = padded_loop
    setattr(trainer, _PADDED, True)


def pin_cache(trainer: Any, max_cache_len: int) -> None:
    """Pin `trainer`'s static cache at `max_cache_len` tokens, as `--generation_kwargs '{"max_cache_len": N}'` does
    (a plan of a run with tools is of such a run, unless made with `--pin_cache false`, and names N). transformers
    keeps a static cache's length on the model as the running maximum of its calls' P + max_new_tokens - 1, so a
    tool turn that reaches a longer bucket leaves every later call at a new length; pinned at the longest any call
    needs, every call has that one. A `ShapeGuard` holding such a plan calls it. The trainer builds its generation
    config after its callbacks' `on_init_end`, so the pin is set on it at each `generate` call, all of which go
    through `_generate_single_turn`."""
    single_turn = getattr(trainer, "_generate_single_turn", None)
    if single_turn is None:
        raise UsageError(f"{type(trainer).__name__} does not generate; pin_cache takes a GRPOTrainer or "
                         "DistillationTrainer")
    if getattr(trainer, _PINNED, None) == max_cache_len:
        return

    @functools.wraps(single_turn)
    def pinned_turn(*args: Any, **kwargs: Any) -> Any:
        generation = trainer.generation_config
        if generation.max_cache_len not in (None, max_cache_len):
            raise UsageError(f"the run pins its cache at max_cache_len {generation.max_cache_len} and the plan at "
                             f"{max_cache_len}; plan the run as it is (`shapeplan analyze` with its generation_kwargs)")
        generation.max_cache_len = max_cache_len
        # the trainer also hands these to `unwrap_model_for_generation`, which sets them on the model's own config
        if isinstance(getattr(trainer, "generation_kwargs", None), dict):
            trainer.generation_kwargs["max_cache_len"] = max_cache_len
        return single_turn(*args, **kwargs)

    trainer._generate_single_turn = pinned_turn
    setattr(trainer, _PINNED, max_cache_len)
