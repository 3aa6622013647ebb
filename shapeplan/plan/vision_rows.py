"""A vision dataset's rows as the collator pads them: each row's length with its image tokens expanded (truncated to
max_length), and its images' keys."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from .rows import Rows
from .vision import FixedSizes
from .vision.family import ImageFamily, ImageKey


@dataclass(frozen=True, slots=True)
class ImageRow:
    """A row of a vision dataset as its rendered text and its images: what its collated length follows from."""

    tokens: int  # the rendered row's tokens, one placeholder token per image
    placeholders: tuple[int, ...]  # the position of each image placeholder among them
    sizes: tuple[tuple[int, int], ...]  # each image's (height, width), as the processor receives it

    def text_runs(self, cut: int = 0) -> tuple[int, ...]:
        """The row's text tokens before, between and after its images (one run more than images), the last run
        `cut` tokens shorter (max_length cuts text after the last image only: a cut into images is refused)."""
        edges = (-1, *self.placeholders, self.tokens)
        runs = [after - before - 1 for before, after in pairwise(edges)]
        runs[-1] -= cut
        return tuple(runs)


class CutImageTokens(ValueError):
    """max_length cuts into a row's image tokens, which the model's forward then refuses."""

    def __init__(self, row: int, length: int) -> None:
        super().__init__(f"row {row} has {length} tokens with its image tokens")
        self.row, self.length = row, length


def image_rows(rows: Sequence[ImageRow], family: ImageFamily, tokens: Callable[[ImageKey], int],
               max_length: int | None, resize: FixedSizes | None = None) -> Rows:
    """The rows' collated lengths (each placeholder expanded to its image's `tokens`, truncated to max_length),
    image keys and text runs; `resize`: every image first resized to one of those fixed sizes (a what-if)."""
    lengths: list[int] = []
    keys: list[tuple[ImageKey, ...]] = []
    runs: list[tuple[int, ...]] = []
    for index, row in enumerate(rows):
        sizes = row.sizes if resize is None else tuple(resize.target(h, w) for h, w in row.sizes)
        row_keys = tuple(family.image(h, w) for h, w in sizes)
        added = sum(tokens(key) - 1 for key in row_keys)
        length = row.tokens + added
        cut = 0
        if max_length is not None and length > max_length:
            if row.placeholders and row.placeholders[-1] + added >= max_length:
                raise CutImageTokens(index, length)
            length, cut = max_length, length - max_length
        lengths.append(length)
        keys.append(row_keys)
        runs.append(row.text_runs(cut))
    return Rows(lengths=tuple(lengths), images=tuple(keys), family=family, text_runs=tuple(runs))
