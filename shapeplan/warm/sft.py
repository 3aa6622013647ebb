"""The SFT warmer: the real `SFTTrainer`, built from the run's own config and model, through the trainer-loop
warm-up (shapeplan/warm/trainer_loop.py). What is SFT's own: the chat template and EOS of the run's tokenizer,
padded or padding-free (packed) batches, and each padding-free (len(cu_seq_lens), max_length_q) pair as a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

from .identity import load_run_tokenizer
from .model import WarmTask
from .synthetic import (
    SyntheticBatch,
    dataset_rows,
    padded_layouts,
    padding_free_batches,
)
from .trainer_loop import TrainerLoopWarmer


class SFTWarmer(TrainerLoopWarmer[SyntheticBatch]):
    """Warms SFT shapes with `trl.SFTTrainer`."""

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

    def layouts(self, task: WarmTask) -> list[SyntheticBatch]:
        """The synthetic batches that reproduce `task`: one per planned layout (padding-free pair; padded, unpadded)."""
        multiple = self.config.pad_to_multiple_of
        if self.padding_free:
            batches, problems = padding_free_batches(task.seq, task.varlen_pairs, multiple)
            self.warnings += [f"{task.label}: {p}" for p in problems]
            return batches
        return padded_layouts(task.batch, task.seq, multiple, padded=task.padded, unpadded=task.unpadded)

    def rows(self, batches: Sequence[SyntheticBatch]) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """Prepared dataset rows for `batches`, and the row indices of each batch."""
        return dataset_rows(batches, self.tokenizer.vocab_size,
                            seq_lengths=self.padding_free and bool(self.config.packing))

    def _eval_batches(self, tasks: Sequence[WarmTask]) -> list[tuple[WarmTask, SyntheticBatch]]:
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
        # the synthetic rows are already prepared
        self.config.dataset_kwargs = {**(self.config.dataset_kwargs or {}), "skip_prepare_dataset": True}
        return super()._build_trainer(train_rows, eval_rows)
