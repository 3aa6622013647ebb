"""The DPO warmer (the shared preference warm-up: warm/preference.py). DPO's step runs the policy and the reference
model on the same tensors, so a planned `ref` (`eval_ref`) shape is warmed by the `train` (`eval`) task of the same
shape. DPO's metrics select the completion tokens of each half of the batch with a boolean mask, so every planned
completion-token count gets a batch whose chosen (or rejected) half has that many."""

from __future__ import annotations

from typing import Any, ClassVar

from .model import WarmTask
from .preference import PRECOMPUTE, PairedBatch, PreferenceWarmer, taking_prepared_rows
from .runner import WARMED_PHASES
from .synthetic import token_ids


def counted_batch(rows: int, longest: int, chosen: int, rejected: int) -> PairedBatch | None:
    """B rows whose chosen halves hold `chosen` completion tokens and rejected halves `rejected`, none longer than
    `longest` and one exactly that long; None when they do not fit."""
    room = longest - 1  # a one-token prompt at least
    if max(chosen, rejected) > rows * room:
        return None

    def fill(total: int) -> list[int]:
        out = []
        for _ in range(rows):
            out.append(min(room, total))
            total -= out[-1]
        return out

    chosen_rows, rejected_rows = fill(chosen), fill(rejected)
    # the first row's prompt makes its longer side `longest` (the others keep a one-token prompt)
    first = (longest - max(chosen_rows[0], rejected_rows[0]), chosen_rows[0], rejected_rows[0])
    return PairedBatch((first, *((1, c, r) for c, r in zip(chosen_rows[1:], rejected_rows[1:], strict=True))))




class DPOWarmer(PreferenceWarmer):
    inner_phases: ClassVar[dict[str, str]] = {"ref": "train", "eval_ref": "eval"}
    phases = (*WARMED_PHASES, PRECOMPUTE)
    ref_columns = ("ref_chosen_logps", "ref_rejected_logps")

    def layouts(self, task: WarmTask) -> list[PairedBatch]:
        """One batch per two planned completion-token counts (chosen half, rejected half), as long as the padded
        layout's longest row (or `seq` where the counts need full rows), then the padded layouts."""
        padded = super().layouts(task)
        longest = max(max(p + c, p + r) for p, c, r in padded[0].rows)
        counts = list(task.completion_tokens)
        counted = []
        for chosen, rejected in zip(counts[::2], counts[1::2] + counts[-1:], strict=False):
            batch = counted_batch(len(padded[0].rows), longest, chosen, rejected)
            counted.append(batch or counted_batch(len(padded[0].rows), task.seq, chosen, rejected))
        return [b for b in counted if b is not None] + padded

    def example(self, counts: tuple[int, ...], offset: int) -> dict[str, Any]:
        prompt, chosen, rejected = counts
        vocab = self.tokenizer.vocab_size
        return {"prompt_ids": token_ids(prompt, vocab, offset), "chosen_ids": token_ids(chosen, vocab, offset + 1),
                "rejected_ids": token_ids(rejected, vocab, offset + 2)}

    def trainer_type(self) -> Any:
        return taking_prepared_rows(super().trainer_type())

