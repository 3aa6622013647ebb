"""Synthetic vision-language rows whose collated batch is exactly a planned one: every row's text runs and images.

The vision tower's graphs follow from the batch's images' keys (Qwen-VL's grids, a tiling family's tile counts);
the language model's, from (batch, seq); and Qwen-VL's forward builds each row's 3-D position ids op by op on the
device (`get_rope_index`: an `arange` per text run, the position grid of each image, their concatenation, a masked
write into the batch), so on an eager device each row's layout of text runs and images is ops of its own sizes. A
synthetic row therefore has the planned row's layout: filler text of each run's length (one filler token per text
token), the image placeholder where each image sits, and an image of a size its family's processor turns into
exactly its key (`ImageFamily.picture`).

The rows go through the run's own collator (`DataCollatorForVisionLanguageModeling`) and processor as text rows:
the batch holds the same tensors as the run's whatever its rows' format (messages, prompt-completion), since the
template's tokens are text tokens like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..adapters.vision import VisionProcessor
from ..errors import PlanFileError
from ..plan.buckets import round_up
from ..plan.vision.family import ImageKey

# Strings tried as the filler text, in order: one token each, however many are joined.
_FILLERS = (" a", " x", " the", "a", "!", " 1")


@dataclass(frozen=True, slots=True)
class VisionRow:
    """One row: its text runs (one more than its images) and its images' keys."""

    runs: tuple[int, ...]
    images: tuple[ImageKey, ...]


@dataclass(frozen=True, slots=True)
class VisionBatch:
    """The rows of one batch, in order."""

    rows: tuple[VisionRow, ...]


def vision_batches(images: Sequence[ImageKey], layouts: Sequence[Sequence[Sequence[int]]]) -> list[VisionBatch]:
    """One batch per layout: its rows' runs, each row taking the next of `images` (the batch's keys, in row order)
    for each of its images."""
    out = []
    for layout in layouts:
        rest = iter(images)
        out.append(VisionBatch(tuple(VisionRow(tuple(runs), tuple(next(rest) for _ in runs[1:])) for runs in layout)))
    return out


def check_layouts(images: Sequence[ImageKey], layouts: Sequence[Sequence[Sequence[int]]], seq: int,
                  multiple: int | None, vision: VisionProcessor, label: str) -> None:
    """Each layout collates to `seq` with the run's processor: its longest row, images expanded, padded up to
    `multiple` (a plan edited by hand, or made with other pixel settings, would warm other shapes than it names)."""
    for batch in vision_batches(images, layouts):
        longest = max(sum(row.runs) + sum(vision.tokens(key) for key in row.images) for row in batch.rows)
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


def vision_rows(batches: Sequence[VisionBatch], vision: VisionProcessor, text_field: str) -> tuple[
        list[dict[str, Any]], list[list[int]]]:
    """Text rows with images (`text_field`, `images`) that collate into `batches`, and each batch's row indices."""
    from PIL import Image

    text = filler(vision.processor)
    placeholder = vision.placeholder
    pictures: dict[ImageKey, Any] = {}
    rows: list[dict[str, Any]] = []
    index: list[list[int]] = []
    for batch in batches:
        members = []
        for row in batch.rows:
            parts = [text * row.runs[0], *(placeholder + text * run for run in row.runs[1:])]
            for key in row.images:
                if key not in pictures:
                    pictures[key] = _picture(Image, key, vision)
            members.append(len(rows))
            rows.append({text_field: "".join(parts), "images": [pictures[key] for key in row.images]})
        index.append(members)
    return rows, index


def _picture(image_module: Any, key: ImageKey, vision: VisionProcessor) -> Any:
    """An RGB image of a size the run's processor turns into `key`; refused where it would give another key (the
    plan was made with other processor settings)."""
    height, width = vision.family.picture(key)
    made = vision.family.image(height, width)
    if made != key:
        raise PlanFileError(f"the run's processor turns a {width}x{height} image into {list(made)}, "
                            f"not the planned {list(key)}: the plan was made with other processor settings; "
                            "re-create it with `shapeplan analyze`")
    return image_module.new("RGB", (width, height), (127, 127, 127))
