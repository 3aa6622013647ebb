"""Synthetic rows whose collated batch has exactly a planned shape.

The content is arbitrary token ids; what matters is what the compiled code depends on: the batch shape, and for
eager attention whether the batch has padding (SDPA skips the mask on a batch without any), and for padding-free
batches the length of `cu_seq_lens` and the value of `max_length_q` (both guarded under `torch.compile`): the
plan says which of these its batches have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..plan.buckets import round_up


@dataclass(frozen=True, slots=True)
class SyntheticBatch:
    """The documents of one batch, one row each (a padding-free batch concatenates them)."""

    documents: tuple[int, ...]


def padded_layouts(batch: int, seq: int, multiple: int | None, *, padded: bool, unpadded: bool) -> list[
        SyntheticBatch]:
    """A (batch, seq) batch with padding (`padded`) and one without (`unpadded`: every row `seq` tokens)."""
    unit = None if multiple in (None, 1) else multiple
    out = []
    if padded:
        longest = seq - 1 if unit is not None else seq
        out.append(SyntheticBatch((longest, *[max(longest - 1, 1)] * (batch - 1))))
    if unpadded:
        out.append(SyntheticBatch((seq,) * batch))
    return out


def padded_batches(batch: int, seq: int, multiple: int | None, max_length: int | None) -> list[SyntheticBatch]:
    """The padded layouts (batch, seq) can arrive in, for a plan that does not count its unpadded batches: with
    padding, and without where rows can all be `seq` long.

    A batch has no padding when every row is exactly `seq` tokens; that is certain for one row without a padding
    multiple, and reachable when rows are cut at `max_length == seq` or when one row's length is a multiple.
    """
    unit = None if multiple in (None, 1) else multiple
    return padded_layouts(batch, seq, multiple, padded=not (unit is None and batch == 1),
                          unpadded=unit is None or batch == 1 or seq == max_length)


def padding_free_documents(seq: int, cu_len: int, max_q: int, multiple: int | None) -> tuple[int, ...] | None:
    """Document lengths whose padding-free batch is (1, seq) with len(cu_seq_lens) == cu_len and
    max_length_q == max_q; None when no such batch exists.

    The collator pads the concatenation to `seq` with position id 0, so each pad token is a one-token document:
    cu_len = documents + pads + 1 and max_length_q = max(longest document, 1 if pads).
    """
    for pads in range(0, max(multiple or 1, 1)):
        tokens = seq - pads
        docs = cu_len - 1 - pads
        if tokens <= 0 or docs < 1 or round_up(tokens, multiple) != seq:
            continue
        longest = 1 if (max_q == 1 and pads) else max_q
        if (pads and longest > max_q) or longest > tokens:
            continue
        rest, slots = tokens - longest, docs - 1
        if not slots <= rest <= slots * longest or (slots == 0 and rest != 0):
            continue
        lengths = [longest]
        for i in range(slots):
            left = slots - i - 1
            take = min(longest, rest - left)
            lengths.append(take)
            rest -= take
        return tuple(lengths)
    return None


def padding_free_batches(seq: int, varlen_pairs: Sequence[tuple[int, int]], multiple: int | None) -> tuple[
        list[SyntheticBatch], list[str]]:
    """One batch per planned (len(cu_seq_lens), max_length_q) pair; and, as warnings, the pairs no batch can meet.
    No pairs (a bound's entry): one document filling the batch up to the last multiple."""
    if not varlen_pairs:
        padded = multiple not in (None, 1) and seq > 1
        varlen_pairs = [(3, seq - 1) if padded else (2, seq)]
    batches, problems = [], []
    for cu, max_q in varlen_pairs:
        documents = padding_free_documents(seq, cu, max_q, multiple)
        if documents is None:
            problems.append(f"no padding-free batch of length {seq} has len(cu_seq_lens)={cu} and max_length_q={max_q}")
        else:
            batches.append(SyntheticBatch(documents))
    return batches, problems


def token_ids(length: int, vocab_size: int, offset: int = 0) -> list[int]:
    """Arbitrary in-vocabulary ids (ids 0..9 are left out: special tokens usually live there)."""
    span = max(vocab_size - 10, 1)
    return [10 + (offset + i) % span for i in range(length)]


def dataset_rows(batches: Sequence[SyntheticBatch], vocab_size: int, *, seq_lengths: bool) -> tuple[
        list[dict[str, Any]], list[list[int]]]:
    """Prepared-dataset rows (input_ids, labels, and seq_lengths when packed rows carry it) for `batches`, and the
    row indices of each batch."""
    rows: list[dict[str, Any]] = []
    index: list[list[int]] = []
    for b in batches:
        members = []
        for length in b.documents:
            ids = token_ids(length, vocab_size, offset=len(rows))
            row: dict[str, Any] = {"input_ids": ids, "labels": list(ids)}
            if seq_lengths:
                row["seq_lengths"] = [length]
            members.append(len(rows))
            rows.append(row)
        index.append(members)
    return rows, index
