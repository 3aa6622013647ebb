"""Prepared rows reduced to what shapes depend on: their token lengths (and packed documents)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from .buckets import round_up
from .vision.family import ImageFamily, ImageKey, Inputs


@dataclass(frozen=True, slots=True)
class Rows:
    """Token lengths of the prepared dataset's rows, in dataset order.

    `documents` holds, for packed rows, the lengths of the documents packed into each row (`seq_lengths`);
    None means each row is one document. Rows with images (vision-language data) hold each row's images' keys in
    `images`, the family that made them (`shapeplan.plan.vision`) in `family`, and in `text_runs` each row's text
    tokens before, between and after its images: Qwen-VL's forward builds each row's position ids from these runs,
    op by op on the device.
    """

    lengths: tuple[int, ...]
    documents: tuple[tuple[int, ...], ...] | None = None
    images: tuple[tuple[ImageKey, ...], ...] | None = None
    family: ImageFamily | None = None
    text_runs: tuple[tuple[int, ...], ...] | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def documents_of(self, row: int) -> tuple[int, ...]:
        return self.documents[row] if self.documents is not None else (self.lengths[row],)

    def vision(self, batch: Sequence[int], *, shuffled: bool = False) -> BatchImages:
        """What a batch of these rows feeds the model besides its text (nothing for text rows, or a batch without
        images); `shuffled`: the images' keys in sorted order, the key of every order a shuffle of the rows gives."""
        if self.images is None or self.family is None or not any(self.images[i] for i in batch):
            return NO_IMAGES
        rows = [self.images[i] for i in batch]
        keys = tuple(key for row in rows for key in row)
        return BatchImages(pixel_values=self.family.pixel_values(rows),
                           images=tuple(sorted(keys)) if shuffled else keys, inputs=self.family.inputs(rows))

    def runs(self, batch: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Each row's text runs, in row order (() for text rows)."""
        return () if self.text_runs is None else tuple(self.text_runs[i] for i in batch)


@dataclass(frozen=True, slots=True)
class BatchImages:
    """What a batch's images feed the model: the pixel tensor's shape, each image's key in row order, and the other
    tensors the images add (none of them for a batch without images)."""

    pixel_values: tuple[int, ...] | None = None
    images: tuple[ImageKey, ...] = ()
    inputs: Inputs = ()


NO_IMAGES = BatchImages()


@dataclass(frozen=True, slots=True)
class BatchShape:
    batch: int
    seq: int
    tokens: int  # real (non-pad) tokens
    cu_seq_lens: int | None = None  # padding-free only: length of cu_seq_lens_q/k
    max_length_q: int | None = None  # padding-free only: longest document, pads count as 1-token documents
    completion_tokens: tuple[int, ...] = ()  # DPO/KTO policy forwards: chosen and rejected completion-token counts
    chosen_rows: int | None = None  # KTO policy forwards: desirable rows in the batch
    unpadded: bool = False  # no pad token: attention runs without a mask
    vision: BatchImages = NO_IMAGES  # vision batches: what the batch's images feed the model
    text_runs: tuple[tuple[int, ...], ...] = ()  # vision batches: each row's text runs around its images


@dataclass(frozen=True, slots=True)
class Dispatched(Sequence[int]):
    """A rank's slice of a batch that accelerate's `dispatch_batches` collates on rank 0: the slice's rows, and
    the parts rank 0 collated one by one and concatenated before slicing (each padded on its own)."""

    rows: tuple[int, ...]
    parts: tuple[tuple[int, ...], ...]

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[int]:
        return iter(self.rows)


class UnequalParts(ValueError):
    """Rank 0 would concatenate dispatched parts padded to different lengths (`seqs`), which torch.cat fails on."""

    def __init__(self, seqs: Sequence[int]) -> None:
        super().__init__(f"parts padded to {', '.join(map(str, seqs))}")
        self.seqs = tuple(seqs)


def collated_seq(batch: Sequence[int], longest: Callable[[Sequence[int]], int]) -> int:
    """The padded length of `batch`, `longest(rows)` being what the collator pads a batch of `rows` to; a
    dispatched slice keeps the padding of the parts rank 0 collated, which must agree (UnequalParts)."""
    if not isinstance(batch, Dispatched):
        return longest(batch)
    seqs = sorted({longest(part) for part in batch.parts})
    if len(seqs) > 1:
        raise UnequalParts(seqs)
    return seqs[0]


def padded_batch(rows: Rows, batch: Sequence[int], multiple: int | None) -> BatchShape:
    """`DataCollatorForLanguageModeling` with padding: (rows, longest row rounded up)."""
    lengths = [rows.lengths[i] for i in batch]
    seq = collated_seq(batch, lambda part: round_up(max(rows.lengths[i] for i in part), multiple))
    return BatchShape(batch=len(batch), seq=seq, tokens=sum(lengths), unpadded=sum(lengths) == len(batch) * seq,
                      vision=rows.vision(batch), text_runs=rows.runs(batch))


def padding_free_batch(rows: Rows, batch: Sequence[int], multiple: int | None) -> BatchShape:
    """`DataCollatorForLanguageModeling` padding-free: every row concatenated into one row of (1, R(total)).

    Pad positions get position id 0, so each pad token starts a one-token document of its own. Only one document
    without pad has position ids that are one run, which attention takes as an unpadded batch.
    """
    documents = [d for i in batch for d in rows.documents_of(i)]
    tokens = sum(documents)
    seq = round_up(tokens, multiple)
    pads = seq - tokens
    return BatchShape(
        batch=1,
        seq=seq,
        tokens=tokens,
        cu_seq_lens=len(documents) + pads + 1,
        max_length_q=max(max(documents), 1 if pads else 0),
        unpadded=len(documents) == 1 and not pads,
    )


def reachable_seqs(rows: Rows, size: int, multiple: int | None, *, padding_free: bool) -> tuple[int, ...]:
    """Every `seq` a batch of `size` rows can have in some order of the rows (a bound for unreplayable orders).

    Padded: the batch's longest row sets it, and a row can be the longest only if `size - 1` others are no longer.
    Padding-free: the batch's total lies between the `size` shortest and the `size` longest rows' totals; every
    padded length in between is kept. A batch larger than the dataset repeats rows (accelerate's even batches).
    """
    ordered = sorted(rows.lengths)
    if padding_free:
        if size <= len(ordered):
            low, high = sum(ordered[:size]), sum(ordered[-size:])
        else:
            low, high = size * ordered[0], size * ordered[-1]
        step = multiple or 1
        return tuple(range(round_up(low, multiple), round_up(high, multiple) + 1, step))
    candidates = ordered[size - 1:] if size <= len(ordered) else ordered
    return tuple(sorted({round_up(length, multiple) for length in candidates}))
