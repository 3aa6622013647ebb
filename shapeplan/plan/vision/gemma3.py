"""Images as a Gemma 3 processor turns them into device inputs: every image resized to one fixed size (`size`),
`image_seq_length` (256) image tokens wrapped as "\\n\\n<boi>...<eoi>\\n\\n"; with pan-and-scan, an image of aspect
ratio over `pan_and_scan_min_ratio_to_activate` also cropped into 2 to `pan_and_scan_max_num_crops` crops, each
resized to that size and given its own image text. Pure arithmetic, equal to transformers' (`pan_and_scan` and
`_preprocess` of `gemma3/image_processing_pil_gemma3.py`, `replace_image_token` of `processing_gemma3.py`);
tests/plan/test_vision_families.py proves it.

The settings that decide are those the processor passes at call, not only the image processor's own:
`Gemma3Processor.images_kwargs` passes do_pan_and_scan=False, crops of 256 pixels at least, 4 at most, from a ratio
of 1.2, over whatever preprocessor_config.json says, unless the processor was loaded with other values
(`AutoProcessor.from_pretrained(model, do_pan_and_scan=True)`, which its tokenizer_config.json then keeps).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Self

from .family import ImageKey, Inputs, Setting
from .settings import call_settings, setting, size_key, whole


def _whole(name: str, value: Any) -> int:
    # pan-and-scan settings are the processor's call kwargs (preprocessor_config.json's are overridden)
    fix = (f"load the processor with {name}=N (AutoProcessor.from_pretrained, kept in tokenizer_config.json)"
           if name.startswith("pan_and_scan") else "set it in preprocessor_config.json")
    return whole("Gemma 3 image processor", name, value, fix)


@dataclass(frozen=True, slots=True)
class Gemma3Images:
    """A Gemma 3 processor's image settings. An image's key is () without pan-and-scan (every image alike), else
    (crops,): its crops (0 when its aspect ratio is under the threshold or a crop would be too small)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("gemma3",)
    # 1 on image tokens, 0 elsewhere, on every batch, images or not (the processor always writes it)
    TEXT_INPUTS: ClassVar[tuple[str, ...]] = ("token_type_ids",)
    PLACEHOLDER: ClassVar[str] = "image_token"  # the processor's: `<start_of_image>`, the tokenizer's boi_token
    # its expansion opens and closes with newlines, which the tokenizer merges with the row's own
    MERGES_WITH_TEXT: ClassVar[bool] = True
    KEYS_TENSOR: ClassVar[str | None] = None

    height: int  # size.height, size.width: every image and crop is resized to this
    width: int
    pan_and_scan: bool = False
    min_crop_size: int = 256
    max_crops: int = 4
    min_ratio: float = 1.2

    @classmethod
    def from_image_processor(cls, image_processor: Any, images_kwargs: Mapping[str, Any] | None = None) -> Self:
        """The settings of a (PIL or torchvision) `Gemma3ImageProcessor`, `images_kwargs` over them: what the
        processor passes it at call (`processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs)
        ["images_kwargs"]`), which is where pan-and-scan is decided."""
        overrides = images_kwargs or {}
        if not setting(image_processor, overrides, "do_resize"):
            raise ValueError("Gemma 3 image processor has do_resize false, which leaves each image its own size "
                             "(pixel_values of mixed sizes cannot be batched); set do_resize true in "
                             "preprocessor_config.json")
        if setting(image_processor, overrides, "do_convert_rgb") is False:
            raise ValueError("Gemma 3 image processor has do_convert_rgb false, which keeps a grayscale or RGBA "
                             "image's channels (pixel_values that do not batch with RGB ones); set it true")
        size = setting(image_processor, overrides, "size")
        height, width = size_key(size, "height"), size_key(size, "width")
        # the backend's resize takes shortest_edge or max_height before height and width: sizes of aspect kept
        if height is None or width is None or any(size_key(size, key) for key in
                                                  ("shortest_edge", "longest_edge", "max_height", "max_width")):
            raise ValueError(f"Gemma 3 image processor's size {size!r} is not a height and width alone (only "
                             "those resize every image to one size); set size={'height': N, 'width': N} in "
                             "preprocessor_config.json")
        if not setting(image_processor, overrides, "do_pan_and_scan"):
            return cls(height=_whole("size.height", height), width=_whole("size.width", width))
        ratio = setting(image_processor, overrides, "pan_and_scan_min_ratio_to_activate")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < math.inf:
            raise ValueError(f"Gemma 3 image processor's pan_and_scan_min_ratio_to_activate is {ratio!r}, not a "
                             "positive number; load the processor with pan_and_scan_min_ratio_to_activate=1.2")
        return cls(height=_whole("size.height", height), width=_whole("size.width", width), pan_and_scan=True,
                   min_crop_size=_whole("pan_and_scan_min_crop_size",
                                        setting(image_processor, overrides, "pan_and_scan_min_crop_size")),
                   max_crops=_whole("pan_and_scan_max_num_crops",
                                    setting(image_processor, overrides, "pan_and_scan_max_num_crops")),
                   min_ratio=float(ratio))

    @classmethod
    def from_processor(cls, processor: Any) -> Self:
        """The settings a `Gemma3Processor` uses at call: its image processor's, under its merged images kwargs."""
        return cls.from_image_processor(processor.image_processor, call_settings(processor))

    def crops(self, height: int, width: int) -> int:
        """`pan_and_scan`: the crops of an image of this size (0: the image alone)."""
        if not self.pan_and_scan:
            return 0
        long, short = max(height, width), min(height, width)
        if long / short < self.min_ratio:
            return 0
        # as many crops as the aspect ratio rounds to (half up), none under min_crop_size long, 2 to max_crops
        count = min(self.max_crops, max(2, min(math.floor(long / self.min_crop_size),
                                               math.floor(long / short + 0.5))))
        if min(math.ceil(long / count), short) < self.min_crop_size:
            return 0
        return count

    def settings(self, sizes: Sequence[tuple[int, int]]) -> tuple[Setting, ...]:
        if not self.pan_and_scan:
            return ()
        return (Setting("pan-and-scan off", replace(self, pan_and_scan=False),
                        "AutoProcessor.from_pretrained(model, do_pan_and_scan=False), or \"do_pan_and_scan\": false "
                        "in the model's tokenizer_config.json (where the processor reads it at call)"),)

    def generation_refusal(self) -> str | None:
        if self.pan_and_scan:
            return ("TRL 1.16's GRPO and RLOO take another model's branch for Gemma 3's pan-and-scan crops and fail on "
                    "them (its image processor has no crop_to_patches); load the processor without do_pan_and_scan")
        return None

    def image(self, height: int, width: int) -> ImageKey:
        return (self.crops(height, width),) if self.pan_and_scan else ()

    def expansion(self, key: ImageKey, processor: Any) -> str:
        """`Gemma3Processor.replace_image_token`: the image's full sequence, or with crops, the original's and each
        crop's in a sentence. Its leading and trailing "\\n\\n" merge with the newlines around it in Gemma's
        tokenizer: count a row's tokens on its text with every expansion in place."""
        tokenizer = processor.tokenizer
        full = (f"\n\n{tokenizer.boi_token}{tokenizer.image_token * processor.image_seq_length}"
                f"{tokenizer.eoi_token}\n\n")
        crops = key[0] if key else 0
        if not crops:
            return full
        return (f"Here is the original image {full} and here are some crops to help you see better "
                + " ".join([full] * crops))

    def frames(self, key: ImageKey) -> int:
        """The pixel_values rows of one image: the image and its crops."""
        return 1 + (key[0] if key else 0)

    def pixel_values(self, rows: Sequence[Sequence[ImageKey]]) -> tuple[int, ...]:
        """`[images + crops, 3, height, width]`: every image's frames, concatenated in row order (a batch of no
        image has no pixel_values: TRL then passes the processor no images)."""
        return (sum(self.frames(key) for keys in rows for key in keys), 3, self.height, self.width)

    def inputs(self, rows: Sequence[Sequence[ImageKey]]) -> Inputs:
        """None besides pixel_values and token_type_ids (the processor drops the image processor's `num_crops`)."""
        return ()

    def picture(self, key: ImageKey) -> tuple[int, int]:
        crops = key[0] if key else 0
        short = self.min_crop_size
        # uncropped: the processor's own size, or an image too small to crop (a square is cropped under a ratio of
        # 1); cropped: a short side of min_crop_size, whose crops are then floor(long / short), clamped to
        # [2, max_crops]: `crops` squares side by side, or the least ratio that activates pan-and-scan
        candidates = [(self.height, self.width), (1, 1)] if not crops else [
            (short, crops * short), (short, math.ceil(self.min_ratio * short))]
        for height, width in candidates:
            if self.image(height, width) == key:
                return height, width
        raise ValueError(f"no image size gives the key {key} under these pan-and-scan settings")
