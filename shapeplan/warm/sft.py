"""The SFT warmer: the real `SFTTrainer`, built from the run's own config and model, through the trainer-loop
warm-up (shapeplan/warm/trainer_loop.py). What is SFT's own: the chat template and EOS of the run's tokenizer,
padded or padding-free (packed) batches, each padding-free (len(cu_seq_lens), max_length_q) pair as a batch, and
vision-language batches (each planned row layout with images of its grids: shapeplan/warm/vision.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

from ..plan.model import Plan
from .identity import load_run_tokenizer
from .model import WarmTask
from .synthetic import (
    SyntheticBatch,
    dataset_rows,
    padded_layouts,
    padding_free_batches,
)
from .trainer_loop import TrainerLoopWarmer
from .vision import VisionBatch, check_layouts, vision_batches, vision_rows


class SFTWarmer(TrainerLoopWarmer[SyntheticBatch | VisionBatch]):
    """Warms SFT shapes with `trl.SFTTrainer`."""

    vision = False  # the plan's batches carry images (set by bind)

    def bind(self, plan: Plan) -> None:
        super().bind(plan)
        self.vision = any(s.images or s.text_runs for s in plan.shapes)
        for task in self.tasks(plan) if self.vision else ():
            check_layouts(task.images, task.text_runs, task.seq, self.config.pad_to_multiple_of,
                          self.processor, task.label)

    def _padding_free(self) -> bool:
        return bool(self.config.padding_free or (
            self.config.packing and self.config.packing_strategy in {"bfd", "bfd_split"}))

    @cached_property
    def tokenizer(self) -> Any:
        from ..adapters.common import apply_chat_template_path

        tokenizer = load_run_tokenizer(self.args)
        apply_chat_template_path(tokenizer, self.config.chat_template_path)
        if self.config.eos_token is not None:
            tokenizer.eos_token = self.config.eos_token
        return tokenizer

    @cached_property
    def processor(self) -> Any:
        """The run's processor (vision-language runs), as the planner loads it."""
        from ..adapters.vision import run_processor

        return run_processor(self.args, self.tokenizer)

    def layouts(self, task: WarmTask) -> list[SyntheticBatch | VisionBatch]:
        """The synthetic batches that reproduce `task`: one per planned layout (padding-free pair; padded, unpadded;
        a vision batch's row layout)."""
        if self.vision:
            return list(vision_batches(task.images, task.text_runs))
        multiple = self.config.pad_to_multiple_of
        if self.padding_free:
            batches, problems = padding_free_batches(task.seq, task.varlen_pairs, multiple)
            self.warnings += [f"{task.label}: {p}" for p in problems]
            return list(batches)
        return list(padded_layouts(task.batch, task.seq, multiple, padded=task.padded, unpadded=task.unpadded))

    def rows(self, batches: Sequence[SyntheticBatch | VisionBatch]) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """Prepared dataset rows for `batches` (vision: text rows with images, which the collator processes), and
        the row indices of each batch."""
        if self.vision:
            vision = self.processor
            return vision_rows([b for b in batches if isinstance(b, VisionBatch)], vision,
                               self.config.dataset_text_field)
        return dataset_rows([b for b in batches if isinstance(b, SyntheticBatch)], self.tokenizer.vocab_size,
                            seq_lengths=self.padding_free and bool(self.config.packing))

    def _eval_batches(self, tasks: Sequence[WarmTask]) -> list[tuple[WarmTask, SyntheticBatch | VisionBatch]]:
        """`per_pass` batches of each shape, its layouts in turn (every layout at least once)."""
        out = []
        for task in tasks:
            layouts = self.layouts(task)
            out += [(task, layouts[i % len(layouts)]) for i in range(max(task.per_pass, len(layouts)))]
        return out

    def _short(self, task: WarmTask | None) -> bool:
        # a padding-free batch is one row whatever its rows: the short batch's shape is a full one's
        return task is not None and not self.padding_free and task.batch == self.eval_short

    def _build_trainer(self, train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]] | None) -> Any:
        if self.vision:
            # text rows with images: the run's collator renders nothing, so the loss masks of a conversational or
            # prompt-completion run (labels' values, not shapes) are not asked of it, and the text column is kept
            # (a vision dataset's kept columns are messages, prompt, completion and the images)
            self.config.assistant_only_loss = False
            self.config.completion_only_loss = None
            self.config.remove_unused_columns = False
        else:  # the synthetic rows are already prepared
            self.config.dataset_kwargs = {**(self.config.dataset_kwargs or {}), "skip_prepare_dataset": True}
        return super()._build_trainer(train_rows, eval_rows)

    def _trainer_kwargs(self) -> dict[str, Any]:
        # the processor as the planner loads it (AutoProcessor would also build a video processor)
        return {"processing_class": self.processor.processor} if self.vision else {}
