"""Preference rows (DPO, KTO, Reward): what their collators make of prepared row lengths."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .buckets import round_up
from .rows import BatchShape


@dataclass(frozen=True, slots=True)
class PairedRows:
    """Token lengths of prepared paired rows, in dataset order: the chosen and the rejected sequence of each row
    (prompt included), before the collator truncates them."""

    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    prompt: tuple[int, ...] = ()  # DPO: the prompt's share of both (its completions follow it)

    def __len__(self) -> int:
        return len(self.chosen)


def clipped(length: int, max_length: int | None) -> int:
    """The length the collator keeps: it cuts every sequence to max_length (from either end) before padding."""
    return length if max_length is None else min(length, max_length)


def padded_rows(lengths: Sequence[int], multiple: int | None, max_length: int | None = None) -> BatchShape:
    """Right-padded rows: (rows, longest clipped row rounded up to the multiple)."""
    kept = [clipped(n, max_length) for n in lengths]
    seq = round_up(max(kept), multiple)
    return BatchShape(batch=len(kept), seq=seq, tokens=sum(kept), unpadded=sum(kept) == len(kept) * seq)


def stacked_batch(rows: PairedRows, batch: Sequence[int], multiple: int | None,
                  max_length: int | None = None) -> BatchShape:
    """All chosen sequences then all rejected ones, in one padded batch of 2 x rows."""
    return padded_rows([rows.chosen[i] for i in batch] + [rows.rejected[i] for i in batch], multiple, max_length)


def completion_tokens(prompt: int, total: int, max_length: int | None, truncation_mode: str) -> int:
    """The completion tokens of one sequence that TRL's metrics select: its completion mask, cut as the collator
    cuts it, without the first position (`completion_mask[..., 1:]`)."""
    completion = total - prompt
    kept = total if max_length is None else min(total, max_length)
    if truncation_mode == "keep_end":
        ones = min(completion, kept)
        first_is_completion = kept > 0 and completion >= kept
    else:
        ones = max(0, kept - prompt)
        first_is_completion = kept > 0 and prompt == 0
    return ones - first_is_completion
