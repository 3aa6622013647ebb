"""Distillation (TRL's on-policy `DistillationTrainer`): GRPO's generation loop with one generation per prompt, where
the forwards over each round's completions are the student's (`train`) and the teacher's (`teacher`).

The trainer generates every `gradient_accumulation_steps` micro-steps on the rank's `B * GA` prompts, pads the
whole round to (P, C), shuffles it and trains on `GA` slices of `B` rows; each micro-step runs the student backbone
with grad and the teacher backbone without, both on `(B, P + C)`. The teacher forwards of a round are therefore
`GA` forwards of `B` rows within the round's optimizer step: the generation planner's per-round forwards in chunks of
`B`. The eval loop generates on each eval batch, then runs the student (`eval`) and the teacher (`eval_teacher`).
`logits_to_keep` is C, what TRL passes to `_get_last_hidden_state` (which hands the backbone C + 1). With tools,
the trainer's tool loop is GRPO's (`ToolLoop`).
"""

from __future__ import annotations

from .grpo import GenerationLayout, ToolLoop


def distillation_layout(*, batch_size: int, gradient_accumulation_steps: int, pad_to_multiple_of: int | None,
                        max_new_tokens: int, static_cache: bool, max_cache_len: int | None,
                        eval_batch_size: int, tool_loop: ToolLoop | None = None) -> GenerationLayout:
    """The `GenerationLayout` for `plan_generation(method="distillation", ...)`."""
    return GenerationLayout(
        batch_size=batch_size,
        steps_per_generation=gradient_accumulation_steps,
        num_iterations=1,
        pad_to_multiple_of=pad_to_multiple_of,
        max_new_tokens=max_new_tokens,
        static_cache=static_cache,
        max_cache_len=max_cache_len,
        round_forwards=("teacher",),
        eval_batch_size=eval_batch_size,
        eval_forwards=("eval", "eval_teacher"),
        tool_loop=tool_loop,
    )

