"""What a vision-language family is to the planner: one image's device inputs from its size, the text one image
placeholder becomes, and the tensors a batch of images is padded into.

Each family is one module beside this one (`qwen2_vl`, `gemma3`, `idefics3`, `llava`, `llava_next`), as transformers
keeps one `image_processing_<family>.py` per family: its settings (read from the run's image processor), the
arithmetic of its `_preprocess` and its processor's text expansion, each proven equal to transformers' own by the
family's test. `FAMILIES` maps each `config.model_type` shapeplan plans to its module's family class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

# What one image feeds the device, as its family defines it: for Qwen-VL its `image_grid_thw` row (t, h, w); for a
# tiling family its tile counts; () for a family whose images are all one fixed size. Two images with one key give
# the same tensors and the same tokens.
ImageKey = tuple[int, ...]

# The tensors a batch feeds the model besides input_ids, attention_mask and labels: name -> shape (image_sizes and
# image_grid_thw hold values the forward reads; their shapes stand for them here, the keys carry the values).
Inputs = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True, slots=True)
class Setting:
    """A processor setting that fixes a family's vision graphs (`advise`'s what-if): the family under it, or
    (`sizes`) every image first resized to one of those (height, width) sizes; and how a user applies it."""

    label: str
    family: ImageFamily
    apply: str
    sizes: tuple[tuple[int, int], ...] = ()
    pixel_limits: tuple[int, int] | None = None  # the (min_pixels, max_pixels) it gives a processor that has them


class ImageFamily(Protocol):
    """One family's image arithmetic under one processor's settings (a frozen dataclass per family)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]]  # the `config.model_type`s whose processor this is
    TEXT_INPUTS: ClassVar[tuple[str, ...]]  # tensors the images add shaped as input_ids (Gemma 3's token_type_ids)
    PLACEHOLDER: ClassVar[str]  # the processor attribute naming the token a chat template writes for an image
    # whether an expansion's tokens can merge with the text around it (plain text at its ends): a row's length is
    # then counted on its expanded text, not as its placeholders' expansions added to its own tokens
    MERGES_WITH_TEXT: ClassVar[bool]
    # the batch tensor that holds its images' keys (Qwen-VL's image_grid_thw), which plans name them by and the guard
    # reads; None where a batch shows its images only through its tensors' shapes (the guard then checks those)
    KEYS_TENSOR: ClassVar[str | None]

    @classmethod
    def from_processor(cls, processor: Any) -> ImageFamily:
        """The family's settings as the run's processor (and its image processor) holds them; ValueError names a
        setting the arithmetic cannot use, and its fix, in words that follow the model's name ("image processor has
        do_resize false, ...": the caller writes "<model>'s image processor has ...")."""
        ...

    def settings(self, sizes: Sequence[tuple[int, int]]) -> tuple[Setting, ...]:
        """The settings that would fix its vision graphs where they vary with the images (none where every image
        gives one key already), for a run of images of these (height, width) sizes (a family whose settings follow
        the images takes them from their distribution)."""
        ...

    def generation_refusal(self) -> str | None:
        """Why GRPO and RLOO with these images cannot be planned exactly (None where they can: TRL cuts each
        micro-batch's pixels by its own images, whatever the shuffle)."""
        ...

    def image(self, height: int, width: int) -> ImageKey:
        """The key of an image of this size, as the processor receives it (ImageSizeError where it refuses it)."""
        ...

    def expansion(self, key: ImageKey, processor: Any) -> str:
        """The text the processor puts where the image's placeholder was (its special tokens read from `processor`,
        as the processor's `__call__` reads them)."""
        ...

    def pixel_values(self, rows: Sequence[Sequence[ImageKey]]) -> tuple[int, ...]:
        """The shape of the batch's `pixel_values`: `rows` holds each row's images' keys, in row order."""
        ...

    def inputs(self, rows: Sequence[Sequence[ImageKey]]) -> Inputs:
        """Every other tensor of the batch that images add, by name (not `pixel_values`, nor the TEXT_INPUTS)."""
        ...

    def picture(self, key: ImageKey) -> tuple[int, int]:
        """A (height, width) that the processor turns into `key`: the size of a warm-up's synthetic image."""
        ...
