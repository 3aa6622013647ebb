"""Synthetic vision-language rows whose collated batch is exactly a planned one: every row's text runs and images.

The vision tower's graphs follow from the batch's grids; the language model's, from (batch, seq); and Qwen-VL's
forward builds each row's 3-D position ids op by op on the device (`get_rope_index`: an `arange` per text run, the
position grid of each image, their concatenation, a masked write into the batch), so on an eager device each row's
layout of text runs and images is ops of its own sizes. A synthetic row therefore has the planned row's layout:
filler text of each run's length (one filler token per text token), the image placeholder where each image sits,
and an image of exactly its grid's pixel size, which the processor keeps as it is.

The rows go through the run's own collator (`DataCollatorForVisionLanguageModeling`) and processor as text rows:
the batch holds the same tensors as the run's whatever its rows' format (messages, prompt-completion), since the
template's tokens are text tokens like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import PlanFileError
from ..plan.buckets import round_up
from ..plan.vision import Grid, ImageProcessing

# Strings tried as the filler text, in order: one token each, however many are joined.
_FILLERS = (" a", " x", " the", "a", "!", " 1")


@dataclass(frozen=True, slots=True)
class VisionRow:
    """One row: its text runs (one more than its images) and its images' grids."""

    runs: tuple[int, ...]
    grids: tuple[Grid, ...]


@dataclass(frozen=True, slots=True)
class VisionBatch:
    """The rows of one batch, in order."""

    rows: tuple[VisionRow, ...]


def vision_batches(grids: Sequence[Grid], layouts: Sequence[Sequence[Sequence[int]]]) -> list[VisionBatch]:
    """One batch per layout: its rows' runs, each row taking the next of `grids` (the batch's, in row order) for
    each of its images."""
    out = []
    for layout in layouts:
        rest = iter(grids)
        out.append(VisionBatch(tuple(VisionRow(tuple(runs), tuple(next(rest) for _ in runs[1:])) for runs in layout)))
    return out


def check_layouts(grids: Sequence[Grid], layouts: Sequence[Sequence[Sequence[int]]], seq: int,
                  multiple: int | None, images: ImageProcessing, label: str) -> None:
    """Each layout collates to `seq` with the run's processor: its longest row, images expanded, padded up to
    `multiple` (a plan edited by hand, or made with other pixel settings, would warm other shapes than it names)."""
    for batch in vision_batches(grids, layouts):
        longest = max(sum(row.runs) + sum(images.tokens(grid) for grid in row.grids) for row in batch.rows)
        if round_up(longest, multiple) != seq:
            raise PlanFileError(f"the plan's {label} has a row layout {longest} tokens long, which pads to "
                                f"{round_up(longest, multiple)}, not {seq}; re-create the plan with `shapeplan "
                                "analyze`")


def filler(processor: Any) -> str:
    """A string the run's tokenizer makes one token of, however many are joined, and that is no placeholder or
    multimodal token: the text of a synthetic run."""
    tokenizer = processor.tokenizer
    special = {getattr(processor, name, None) for name in ("image_token_id", "video_token_id", "audio_token_id")}
    special |= set(tokenizer.all_special_ids)
    for text in _FILLERS:
        three = tokenizer(text * 3, add_special_tokens=False)["input_ids"]
        five = tokenizer(text * 5, add_special_tokens=False)["input_ids"]
        if len(three) == 3 and len(set(three)) == 1 and five == three[:1] * 5 and three[0] not in special:
            return text
    raise PlanFileError("the run's tokenizer makes no single token of any filler text shapeplan tries "
                        f"({', '.join(map(repr, _FILLERS))}), so warm cannot build rows of the planned lengths")


def vision_rows(batches: Sequence[VisionBatch], processor: Any, images: ImageProcessing, text_field: str) -> tuple[
        list[dict[str, Any]], list[list[int]]]:
    """Text rows with images (`text_field`, `images`) that collate into `batches`, and each batch's row indices."""
    from PIL import Image

    text = filler(processor)
    placeholder = processor.image_token
    pictures: dict[Grid, Any] = {}
    rows: list[dict[str, Any]] = []
    index: list[list[int]] = []
    for batch in batches:
        members = []
        for row in batch.rows:
            parts = [text * row.runs[0], *(placeholder + text * run for run in row.runs[1:])]
            for grid in row.grids:
                if grid not in pictures:
                    pictures[grid] = _picture(Image, grid, images)
            members.append(len(rows))
            rows.append({text_field: "".join(parts), "images": [pictures[grid] for grid in row.grids]})
        index.append(members)
    return rows, index


def _picture(image_module: Any, grid: Grid, images: ImageProcessing) -> Any:
    """An RGB image of `grid`'s pixel size, which the processor resizes to itself (a multiple of its factor within
    its pixel limits); refused where the run's processor would give it another grid."""
    _, h, w = grid
    height, width = h * images.patch_size, w * images.patch_size
    if images.grid(height, width) != grid:
        raise PlanFileError(f"the run's processor turns a {width}x{height} image into the grid "
                            f"{list(images.grid(height, width))}, not the planned {list(grid)}: the plan was made with "
                            "other pixel limits; re-create it with `shapeplan analyze`")
    return image_module.new("RGB", (width, height), (127, 127, 127))
