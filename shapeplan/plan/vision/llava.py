"""Images as a LLaVA-1.5 processor turns them into device inputs: every image resized (shortest edge) and
center-cropped to one size, `(crop / patch_size)**2` image tokens (+ `num_additional_image_tokens`, - 1 with the
"default" feature strategy: 576 for 336-pixel crops of 14-pixel patches). Pure arithmetic, equal to transformers'
(`_preprocess` of `llava/image_processing_pil_llava.py` and of the CLIP image processor LLaVA-1.5 checkpoints name,
`replace_image_token` of `llava/processing_llava.py`); tests/plan/test_vision_families.py proves it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from .family import ImageKey, Inputs, Setting
from .settings import call_settings, setting, size_key, whole


def _whole(name: str, value: Any) -> int:
    return whole("LLaVA image processor", name, value)


@dataclass(frozen=True, slots=True)
class LlavaImages:
    """A LLaVA-1.5 image processor's settings: the one (height, width) every image is fed at. Every image's key is
    (), its tokens and pixels alike."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("llava",)
    TEXT_INPUTS: ClassVar[tuple[str, ...]] = ()
    PLACEHOLDER: ClassVar[str] = "image_token"  # `<image>`
    MERGES_WITH_TEXT: ClassVar[bool] = False
    KEYS_TENSOR: ClassVar[str | None] = None

    height: int
    width: int

    @classmethod
    def from_image_processor(cls, image_processor: Any, images_kwargs: Mapping[str, Any] | None = None) -> Self:
        """The settings of a (PIL or torchvision) `LlavaImageProcessor` or `CLIPImageProcessor`, `images_kwargs`
        over them (what the processor passes it at call: `processor._merge_kwargs(...)["images_kwargs"]`)."""
        overrides = images_kwargs or {}
        if setting(image_processor, overrides, "do_convert_rgb") is False:
            raise ValueError("LLaVA image processor has do_convert_rgb false, which keeps a grayscale or RGBA "
                             "image's channels (pixel_values that do not batch with RGB ones); set it true")
        if setting(image_processor, overrides, "do_pad") and setting(image_processor, overrides, "pad_size"):
            raise ValueError("LLaVA image processor pads to pad_size, which shapeplan does not plan; drop "
                             "pad_size from preprocessor_config.json")
        if setting(image_processor, overrides, "do_center_crop"):
            crop = setting(image_processor, overrides, "crop_size")
            return cls(height=_whole("crop_size.height", size_key(crop, "height")),
                       width=_whole("crop_size.width", size_key(crop, "width")))
        size = setting(image_processor, overrides, "size")
        # without the crop, only a height and width resize every image to one size (shortest_edge keeps the aspect)
        if not setting(image_processor, overrides, "do_resize") or any(
                size_key(size, key) for key in ("shortest_edge", "longest_edge", "max_height", "max_width")) or not (
                size_key(size, "height") and size_key(size, "width")):
            raise ValueError(f"LLaVA image processor has do_center_crop false and resizes to {size!r} "
                             f"(do_resize {setting(image_processor, overrides, 'do_resize')}), which gives images "
                             "of other sizes other pixel shapes and token counts; set do_center_crop true in "
                             "preprocessor_config.json")
        return cls(height=_whole("size.height", size_key(size, "height")),
                   width=_whole("size.width", size_key(size, "width")))

    @classmethod
    def from_processor(cls, processor: Any) -> Self:
        """The settings a `LlavaProcessor` uses at call: its image processor's, under its merged images kwargs."""
        return cls.from_image_processor(processor.image_processor, call_settings(processor))

    def settings(self, sizes: Sequence[tuple[int, int]]) -> tuple[Setting, ...]:
        return ()  # every image gives one key already

    def generation_refusal(self) -> str | None:
        return None  # one pixel tensor row (block) per image: TRL slices a micro-batch's by its images

    def image(self, height: int, width: int) -> ImageKey:
        return ()

    def tokens(self, processor: Any) -> int:
        """`LlavaProcessor.replace_image_token`: the vision tower's patches of the fed image, with the processor's
        extra tokens (a CLS), less the one the "default" feature strategy drops."""
        patch = processor.patch_size
        if isinstance(patch, bool) or not isinstance(patch, int) or patch < 1:
            raise ValueError(f"LLaVA processor's patch_size is {patch!r}, not a whole number of at least 1; set "
                             "it in processor_config.json (the vision tower's patch size)")
        count = (self.height // patch) * (self.width // patch) + int(processor.num_additional_image_tokens)
        return count - 1 if processor.vision_feature_select_strategy == "default" else count

    def expansion(self, key: ImageKey, processor: Any) -> str:
        return str(processor.image_token) * self.tokens(processor)

    def pixel_values(self, rows: Sequence[Sequence[ImageKey]]) -> tuple[int, ...]:
        """`[images, 3, height, width]` (a batch of no image has no pixel_values)."""
        return (sum(len(keys) for keys in rows), 3, self.height, self.width)

    def inputs(self, rows: Sequence[Sequence[ImageKey]]) -> Inputs:
        return ()

    def picture(self, key: ImageKey) -> tuple[int, int]:
        return self.height, self.width
