"""Images as a LLaVA-NeXT processor turns them into device inputs ("anyres"): the pinpoint resolution that keeps
most of the image, cut into square patches plus a base patch of the whole image, every image's patches padded to the
batch's most; its tokens the base patch's features and the pinpoint's features with the padding cut off and a
newline per row. Pure arithmetic, equal to transformers' (`select_best_resolution`, `get_image_patches` and
`_pad_for_batching` of `llava_next/image_processing_pil_llava_next.py`, `_get_number_of_features` of
`processing_llava_next.py`, and the model's `unpad_image`); tests/plan/test_vision_tiling.py proves it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from .family import ImageKey, Inputs, Setting
from .settings import call_settings, size_key, whole
from .whatif import resize_line


def best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """`select_best_resolution`: the pinpoint keeping the most of the image's pixels, then wasting the fewest."""
    best, kept, wasted = pinpoints[0], 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        if effective > kept or (effective == kept and h * w - effective < wasted):
            best, kept, wasted = (h, w), effective, h * w - effective
    return best


def _side(value: Any, name: str) -> int:
    return whole("image processor", name, value, "fix it in preprocessor_config.json")


@dataclass(frozen=True, slots=True)
class LlavaNextImages:
    """A LLaVA-NeXT image processor's settings and the vision tower's patch size. An image's key is (pinpoint
    height, pinpoint width, unpadded rows, unpadded cols, wide): its pinpoint, the grid of features left once the
    model's `unpad_image` cuts the padding, and whether it cut rows (1, the image wider than its pinpoint) or
    columns (0). The patch count, the tokens and every op of the model's unpadding follow from it; `image_sizes`
    holds each image's own size, which the model reads only through these."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("llava_next",)
    TEXT_INPUTS: ClassVar[tuple[str, ...]] = ()
    PLACEHOLDER: ClassVar[str] = "image_token"  # `<image>`
    MERGES_WITH_TEXT: ClassVar[bool] = False
    KEYS_TENSOR: ClassVar[str | None] = None

    pinpoints: tuple[tuple[int, int], ...]
    frame: int  # the side of every patch in pixel_values (crop_size), a divisor of every pinpoint's sides
    patch_size: int  # the vision tower's patch: a frame is (frame / patch_size)**2 features

    @classmethod
    def from_image_processor(cls, image_processor: Any, images_kwargs: Mapping[str, Any] | None = None, *,
                             patch_size: int | None = None) -> Self:
        """The settings of a (PIL or torchvision) `LlavaNextImageProcessor`, `images_kwargs` over them (what the
        processor passes it at call); `patch_size` is the processor's (`LlavaNextProcessor.patch_size`, the vision
        config's), which the image processor does not hold."""
        overrides = images_kwargs or {}

        def setting(name: str) -> Any:
            return overrides[name] if name in overrides else getattr(image_processor, name, None)

        if patch_size is None:
            raise ValueError("processor has no patch_size, on which LLaVA-NeXT's image tokens depend (the vision "
                             "tower's patch size, which the image processor does not hold); set patch_size in "
                             "processor_config.json")
        size, crop = setting("size"), setting("crop_size")
        # `_preprocess` cuts patches of this side, then resizes and crops each to the frame
        cut = size_key(crop, "height") or size_key(size, "height") or size_key(size, "shortest_edge")
        if setting("do_center_crop"):
            sides = (size_key(crop, "height"), size_key(crop, "width"))
        elif setting("do_resize") and size_key(size, "shortest_edge"):
            sides = (size_key(size, "shortest_edge"),) * 2
        elif setting("do_resize"):
            sides = (size_key(size, "height"), size_key(size, "width"))
        else:
            sides = (cut, cut)
        frame = _side(sides[0], "crop_size.height")
        if sides[1] != frame or cut != frame:
            raise ValueError(f"image processor makes {sides[0]}x{sides[1]} frames from {cut}-pixel patches; "
                             "shapeplan plans square frames of the patches' side (crop_size height = width = the "
                             "size it cuts), as LLaVA-NeXT checkpoints have; fix crop_size / size")
        if not setting("do_pad"):
            raise ValueError("image processor has do_pad false, which leaves the images' patch counts unpadded "
                             "(a ragged pixel_values); set do_pad true")
        points = tuple((_side(h, "image_grid_pinpoints"), _side(w, "image_grid_pinpoints"))
                       for h, w in setting("image_grid_pinpoints") or ())
        if not points or any(h % frame or w % frame for h, w in points):
            raise ValueError(f"image processor's image_grid_pinpoints {list(map(list, points))} are not "
                             f"non-empty multiples of its {frame}-pixel patches, which the processor and the model "
                             "count apart; give pinpoints whose sides are multiples of crop_size")
        if frame % _side(patch_size, "patch_size"):
            raise ValueError(f"processor's patch_size {patch_size} does not divide its {frame}-pixel frames; "
                             "fix patch_size in processor_config.json")
        return cls(pinpoints=points, frame=frame, patch_size=patch_size)

    @classmethod
    def from_processor(cls, processor: Any) -> Self:
        """The settings a `LlavaNextProcessor` uses at call: its image processor's under its merged images kwargs
        (which pad), and its patch size."""
        return cls.from_image_processor(processor.image_processor, call_settings(processor),
                                         patch_size=processor.patch_size)

    def settings(self, sizes: Sequence[tuple[int, int]]) -> tuple[Setting, ...]:
        """Every image resized to a pinpoint first: it then picks that pinpoint and unpads to its whole grid, so
        the images have at most one key a pinpoint."""
        return (Setting(f"images resized to the {len(self.pinpoints)} pinpoints", self, resize_line(self.pinpoints),
                        sizes=self.pinpoints),)

    def generation_refusal(self) -> str | None:
        return ("its forward runs each image's patches and unpadding in the order TRL's shuffle gives the rows, and "
                "pads patches to the round's most, so a micro-batch's ops depend on the shuffle")

    def image(self, height: int, width: int) -> ImageKey:
        """The pinpoint and the unpadded feature grid of `_get_unpadded_features` (= the model's `unpad_image`)."""
        best_h, best_w = best_resolution(height, width, self.pinpoints)
        rows, cols = best_h // self.patch_size, best_w // self.patch_size
        if width / height > cols / rows:
            new = int(round(height * (cols / width), 7))
            return (best_h, best_w, rows - (rows - new) // 2 * 2, cols, 1)
        new = int(round(width * (rows / height), 7))
        return (best_h, best_w, rows, cols - (cols - new) // 2 * 2, 0)

    def patches(self, key: ImageKey) -> int:
        """The image's patches in pixel_values: its pinpoint's, and the base patch."""
        return key[0] // self.frame * (key[1] // self.frame) + 1

    def expansion(self, key: ImageKey, processor: Any) -> str:
        """`replace_image_token`: the base patch's features (plus the processor's num_additional_image_tokens), the
        unpadded grid and a newline per row of it, one fewer with the "default" feature strategy (no CLS)."""
        side = self.frame // self.patch_size
        _, _, rows, cols, _ = key
        tokens = side * side + int(processor.num_additional_image_tokens) + rows * cols + rows
        return str(processor.image_token) * (tokens - int(processor.vision_feature_select_strategy == "default"))

    def pixel_values(self, rows: Sequence[Sequence[ImageKey]]) -> tuple[int, ...]:
        """[the batch's images, their most patches, 3, frame, frame] (the images of all rows in order); () for a
        batch without images."""
        keys = [key for row in rows for key in row]
        return (len(keys), max(map(self.patches, keys)), 3, self.frame, self.frame) if keys else ()

    def inputs(self, rows: Sequence[Sequence[ImageKey]]) -> Inputs:
        """`image_sizes` [images, 2]: each image's own (height, width)."""
        images = sum(len(row) for row in rows)
        return (("image_sizes", (images, 2)),) if images else ()

    def picture(self, key: ImageKey) -> tuple[int, int]:
        """An image of that key: one filling its pinpoint's width (wide) or height, its other side the first, from
        the full side down, that unpads to the key; then the same at twice and four times the pinpoint."""
        best_h, best_w, _, _, wide = key
        for scale in (1, 2, 4):
            for other in range((best_h if wide else best_w) * scale, 0, -1):
                size = (other, best_w * scale) if wide else (best_h * scale, other)
                if self.image(*size) == key:
                    return size
        raise ValueError(f"no image has key {key} under these settings")
