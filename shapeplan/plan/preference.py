"""Preference rows (DPO, KTO, Reward): what their collators make of prepared row lengths."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .buckets import round_up
from .rows import BatchShape, collated_seq


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


def padded_rows(batch: Sequence[int], sequences: Callable[[int], tuple[int, ...]], multiple: int | None,
                max_length: int | None = None) -> BatchShape:
    """Right-padded rows of the `sequences` (token lengths) each example of `batch` collates to: (rows, longest
    clipped row rounded up to the multiple, or for a dispatched slice the padding its collated parts share)."""
    kept = [clipped(n, max_length) for i in batch for n in sequences(i)]
    seq = collated_seq(batch, lambda part: round_up(max(clipped(n, max_length) for i in part for n in sequences(i)),
                                                    multiple))
    return BatchShape(batch=len(kept), seq=seq, tokens=sum(kept), unpadded=sum(kept) == len(kept) * seq)


def stacked_batch(rows: PairedRows, batch: Sequence[int], multiple: int | None,
                  max_length: int | None = None) -> BatchShape:
    """All chosen sequences then all rejected ones, in one padded batch of 2 x rows."""
    return padded_rows(batch, lambda i: (rows.chosen[i], rows.rejected[i]), multiple, max_length)


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
