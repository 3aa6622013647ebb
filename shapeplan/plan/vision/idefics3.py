"""Images as an Idefics3 / SmolVLM / SmolVLM2 processor turns them into device inputs: square frames of one side
(`max_image_size.longest_edge`, L), an image split into rows x cols tiles plus a global frame (or one frame with
`do_image_splitting=False`), each row's frames padded to the batch's most frames. Pure arithmetic, equal to
transformers' (`resize`, `resize_for_vision_encoder`, `split_images` and the padding of
`smolvlm/image_processing_pil_smolvlm.py`, whose idefics3 copy is the same; the expansion of
`processing_smolvlm.py` / `processing_idefics3.py`); tests/plan/test_vision_tiling.py proves it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Self

from .family import ImageKey, Inputs, Setting
from .settings import call_settings, size_key, whole

MAX_IMAGE_SIZE = 4096  # the processor's cap on either side after its first resize


@dataclass(frozen=True, slots=True)
class Idefics3Images:
    """An Idefics3-family image processor's settings. An image's key is (rows, cols) of its tiles, (0, 0) for one
    frame: the frames it feeds (`rows * cols + 1`, or 1), the text it expands to, all follow from it."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("idefics3", "smolvlm")
    TEXT_INPUTS: ClassVar[tuple[str, ...]] = ()
    PLACEHOLDER: ClassVar[str] = "image_token"  # `<image>`
    MERGES_WITH_TEXT: ClassVar[bool] = False
    KEYS_TENSOR: ClassVar[str | None] = None

    tile: int  # max_image_size.longest_edge: every frame is tile x tile
    longest_edge: int | None  # size.longest_edge of the first resize (None: `fixed` or no first resize)
    fixed: tuple[int, int] | None = None  # size.height, size.width of the first resize
    splitting: bool = True

    @classmethod
    def from_image_processor(cls, image_processor: Any, images_kwargs: Mapping[str, Any] | None = None) -> Self:
        """The settings of a (PIL or torchvision) `Idefics3ImageProcessor` / `SmolVLMImageProcessor`, `images_kwargs`
        over them (what the processor passes it at call: `processor._merge_kwargs(...)["images_kwargs"]`)."""
        overrides = images_kwargs or {}

        def setting(name: str) -> Any:
            return overrides[name] if name in overrides else getattr(image_processor, name, None)

        tile = whole("image processor", "max_image_size.longest_edge",
                     size_key(setting("max_image_size"), "longest_edge"),
                     "set max_image_size={'longest_edge': N} in preprocessor_config.json")
        if setting("do_pad") is False:
            raise ValueError("image processor has do_pad false, which leaves each row's frames unpadded (a "
                             "ragged pixel_values the model cannot take); set do_pad true in preprocessor_config.json")
        longest, fixed = None, None
        if setting("do_resize") is not False:
            size = setting("size")
            if size_key(size, "longest_edge"):
                longest = whole("image processor", "size.longest_edge", size_key(size, "longest_edge"), "fix its size")
            elif size_key(size, "height") and size_key(size, "width"):
                fixed = (whole("image processor", "size.height", size_key(size, "height"), "fix its size"),
                         whole("image processor", "size.width", size_key(size, "width"), "fix its size"))
            else:
                raise ValueError(f"image processor's size {size!r} has neither longest_edge nor height and "
                                 "width, which it refuses; set size={'longest_edge': N} in preprocessor_config.json")
        return cls(tile=tile, longest_edge=longest, fixed=fixed, splitting=setting("do_image_splitting") is not False)

    @classmethod
    def from_processor(cls, processor: Any) -> Self:
        """The settings an `Idefics3Processor` / `SmolVLMProcessor` uses at call: its image processor's, under its
        merged images kwargs."""
        return cls.from_image_processor(processor.image_processor, call_settings(processor))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The size after the first resize (`size`): the longest edge scaled to `longest_edge` (up or down, the
        other side made even), then both within 4096."""
        if self.fixed is not None:
            return self.fixed
        if self.longest_edge is None:
            return height, width
        aspect = width / height
        if width >= height:
            width = self.longest_edge
            height = int(width / aspect)
            height += height % 2
        else:
            height = self.longest_edge
            width = int(height * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        aspect = width / height
        if width >= height and width > MAX_IMAGE_SIZE:
            width = MAX_IMAGE_SIZE
            height = int(width / aspect)
        elif height > width and height > MAX_IMAGE_SIZE:
            height = MAX_IMAGE_SIZE
            width = int(height * aspect)
        return max(height, 1), max(width, 1)

    def settings(self, sizes: Sequence[tuple[int, int]]) -> tuple[Setting, ...]:
        if not self.splitting or self.fixed is not None:
            return ()
        return (Setting("one frame per image", replace(self, splitting=False),
                        "\"do_image_splitting\": false in the model's preprocessor_config.json "
                        "(AutoProcessor.from_pretrained(model, do_image_splitting=False) in Python)"),)

    def generation_refusal(self) -> str | None:
        return ("its pixel tensor is padded per row to the round's most frames and its forward splits the image "
                "features by each row's frames in the order TRL's shuffle gives the rows, so a micro-batch's ops "
                "depend on the shuffle (and TRL 1.16 misaligns the pixels of rows with mixed image counts)")

    def image(self, height: int, width: int) -> ImageKey:
        """(rows, cols) of the tiles, as `resize_for_vision_encoder` (both sides rounded up to multiples of the
        tile, the short one from the long one's new length) and `split_images` cut them."""
        if not self.splitting:
            return (0, 0)
        height, width = self.resized(height, width)
        tile, aspect = self.tile, width / height
        if width >= height:
            width = math.ceil(width / tile) * tile
            height = math.ceil(int(width / aspect) / tile) * tile
        else:
            height = math.ceil(height / tile) * tile
            width = math.ceil(int(height * aspect) / tile) * tile
        if height > tile or width > tile:
            return (height // tile, width // tile)
        return (0, 0)

    @staticmethod
    def frames(key: ImageKey) -> int:
        rows, cols = key
        return rows * cols + 1 if rows or cols else 1

    def expansion(self, key: ImageKey, processor: Any) -> str:
        """`get_image_prompt_string` (SmolVLM) / `replace_image_token` (Idefics3): per tile a fake token, its
        `<row_r_col_c>` marker and `image_seq_len` image tokens, a newline after each row of tiles, then the global
        frame. Idefics3's processor calls the global marker `global_image_tag`, SmolVLM's `global_image_token`."""
        rows, cols = key
        fake, image = processor.fake_image_token, processor.image_token
        glob = getattr(processor, "global_image_token", None) or processor.global_image_tag
        frame = image * processor.image_seq_len
        tiles = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{frame}" for c in range(cols)) + "\n"
                        for r in range(rows))
        return (f"{tiles}\n" if rows or cols else "") + f"{fake}{glob}{frame}{fake}"

    def pixel_values(self, rows: Sequence[Sequence[ImageKey]]) -> tuple[int, ...]:
        """[rows, the batch's most frames in a row, 3, L, L] (a row's frames: its images' frames in order; rows
        with fewer padded with zero frames); () for a batch without images, which has no pixel_values."""
        most = max((sum(self.frames(key) for key in row) for row in rows), default=0)
        return (len(rows), most, 3, self.tile, self.tile) if most else ()

    def inputs(self, rows: Sequence[Sequence[ImageKey]]) -> Inputs:
        """`pixel_attention_mask` [rows, most frames, L, L]: ones on every real frame, zeros on padding frames."""
        shape = self.pixel_values(rows)
        return (("pixel_attention_mask", (*shape[:2], *shape[3:])),) if shape else ()

    def picture(self, key: ImageKey) -> tuple[int, int]:
        """An image of that key: the long side as the first resize leaves it, the short side the longest that
        gives the key (the first that does, from square down)."""
        rows, cols = key
        if not self.splitting or self.fixed is not None:
            if key == self.image(self.tile, self.tile):
                return (self.tile, self.tile)
            raise ValueError(f"no image has key {key} under these settings (every image has {self.image(1, 1)})")
        long = self.longest_edge or max(rows, cols, 1) * self.tile
        for short in range(long, 0, -1):
            size = (long, short) if rows > cols else (short, long)
            if self.image(*size) == key:
                return size
        raise ValueError(f"no image has key {key} under these settings")
