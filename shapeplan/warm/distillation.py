"""The Distillation warmer: the real `DistillationTrainer` (student and teacher), built as `trl distillation` builds
it, trains through `Trainer.train()` on synthetic prompts, warmed as GRPO is (shapeplan/warm/generation.py): one
task per planned `generate` size, its rounds decoding to the full max_completion_length, running TRL's
post-processing for every generated length, and one round per planned completion bucket C, whose micro-steps run
the student (`train`) and teacher (`teacher`) forwards on (B, P + C).

What differs from GRPO is the trainer's own: one generation per prompt, a generation batch of B * GA prompts trained
for GA micro-steps, no reward functions, and the teacher built from --teacher_model_name_or_path.
"""

from __future__ import annotations

from typing import Any

from ..plan.model import Phase
from .generation import GenerationWarmer
from .identity import script_objects

# The forwards of a round: on the train side, and in the eval loop.
ROUND_PHASES: tuple[Phase, ...] = ("train", "teacher")
EVAL_ROUND_PHASES: tuple[Phase, ...] = ("eval", "eval_teacher")


class DistillationWarmer(GenerationWarmer):
    """Warms Distillation shapes with `DistillationTrainer` (see the module docstring)."""

    round_phases = ROUND_PHASES
    eval_round_phases = EVAL_ROUND_PHASES

    def _reward_functions(self, extra: int = 0) -> list[Any]:
        return []  # the teacher's log-probabilities are the signal

    def _generations_per_prompt(self) -> int:
        return 1

    @staticmethod
    def _single_turn(trainer: Any, prompt_ids: list[list[int]]) -> Any:
        """One tool-loop `generate` as DistillationTrainer's `_tool_call_loop` calls it."""
        return trainer._generate_single_turn(prompt_ids, None, {})

    def _micro_steps_per_round(self) -> int:
        return self.config.gradient_accumulation_steps

    def _new_trainer(self, dataset: Any) -> Any:
        import trl

        cfg, model_args = self.config, self.args.model
        # as `trl distillation` main() does: the teacher loads like the student, unquantized unless told otherwise
        teacher_init_kwargs = dict(revision=cfg.teacher_model_revision, trust_remote_code=cfg.trust_remote_code,
                                   attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
        teacher_init_kwargs.update(cfg.teacher_model_init_kwargs or {})
        cfg.teacher_model_init_kwargs = teacher_init_kwargs
        return self.args.spec.trainer()(
            model=model_args.model_name_or_path,
            teacher_model=cfg.teacher_model_name_or_path,
            args=cfg,
            train_dataset=dataset,
            quantization_config=trl.get_quantization_config(model_args),
            peft_config=trl.get_peft_config(model_args),
            **({"tools": self.tools} if self.tools else {}),
            **script_objects(self.args),
        )
