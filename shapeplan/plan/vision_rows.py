"""A vision dataset's rows as the collator pads them: each row's length with its image tokens expanded (truncated to
max_length), and its images' grids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .rows import Rows
from .vision import FixedSizes, Grid, ImageProcessing


@dataclass(frozen=True, slots=True)
class ImageRow:
    """A row of a vision dataset as its rendered text and its images: what its collated length follows from."""

    tokens: int  # the rendered row's tokens, one placeholder token per image
    last_placeholder: int | None  # the position of its last image placeholder (None without images)
    sizes: tuple[tuple[int, int], ...]  # each image's (height, width), as the processor receives it


class CutImageTokens(ValueError):
    """max_length cuts into a row's image tokens, which the model's forward then refuses."""

    def __init__(self, row: int, length: int) -> None:
        super().__init__(f"row {row} has {length} tokens with its image tokens")
        self.row, self.length = row, length


def image_rows(rows: Sequence[ImageRow], processing: ImageProcessing, max_length: int | None,
               resize: FixedSizes | None = None) -> Rows:
    """The rows' collated lengths (each placeholder expanded to its image's tokens, truncated to max_length) and
    grids; `resize`: every image first resized to one of those fixed sizes (a what-if)."""
    lengths: list[int] = []
    grids: list[tuple[Grid, ...]] = []
    for index, row in enumerate(rows):
        sizes = row.sizes if resize is None else tuple(resize.target(h, w) for h, w in row.sizes)
        row_grids = tuple(processing.grid(h, w) for h, w in sizes)
        added = sum(processing.tokens(grid) - 1 for grid in row_grids)
        length = row.tokens + added
        if max_length is not None and length > max_length:
            if row.last_placeholder is not None and row.last_placeholder + added >= max_length:
                raise CutImageTokens(index, length)
            length = max_length
        lengths.append(length)
        grids.append(row_grids)
    return Rows(lengths=tuple(lengths), images=tuple(grids), pixel_dim=processing.pixel_dim)
