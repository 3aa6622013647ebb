"""Images as a Qwen2-VL / Qwen2.5-VL processor turns them into vision-tower inputs: a grid per image, image tokens
in the text, patch rows in `pixel_values`. Pure arithmetic over image sizes, equal to transformers' own
(`smart_resize` and the patchify of `image_processing_pil_qwen2_vl.py`; tests/plan/test_vision.py proves it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from .family import ImageKey, Inputs, Setting
from .whatif import FixedSizes, resize_line

Grid = tuple[int, int, int]  # one image's (t, h, w) in patches: a row of `image_grid_thw`, the image's key
SIZE_COUNTS = (1, 2, 3, 4)  # how many fixed sizes each what-if allows


class ImageSizeError(ValueError):
    """An image the processor refuses (its aspect ratio is over 200)."""


@dataclass(frozen=True, slots=True)
class ImageProcessing:
    """The processor settings an image's grid depends on (`preprocessor_config.json`): Qwen2-VL, Qwen2.5-VL and
    Qwen3-VL's `ImageFamily`, an image's key its grid."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    TEXT_INPUTS: ClassVar[tuple[str, ...]] = ()
    PLACEHOLDER: ClassVar[str] = "image_token"
    MERGES_WITH_TEXT: ClassVar[bool] = False
    KEYS_TENSOR: ClassVar[str | None] = "image_grid_thw"

    min_pixels: int
    max_pixels: int
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2

    @classmethod
    def from_processor(cls, processor: Any) -> ImageProcessing:
        """The settings of the processor's (PIL or torchvision) `Qwen2VLImageProcessor`, each checked: a whole
        number of at least 1 (0, -5 or NaN would fail the arithmetic, blamed on the first image), and pixel limits
        some image fits."""
        image_processor = processor.image_processor
        size: Any = image_processor.size  # a SizeDict once built, whichever keys the config used
        settings = cls(min_pixels=_whole("min_pixels (size.shortest_edge)", getattr(size, "shortest_edge", None)),
                       max_pixels=_whole("max_pixels (size.longest_edge)", getattr(size, "longest_edge", None)),
                       **{name: _whole(name, getattr(image_processor, name, None))
                          for name in ("patch_size", "merge_size", "temporal_patch_size")})
        if settings.min_pixels > settings.max_pixels:
            raise ValueError(f"image processor has min_pixels {settings.min_pixels} above max_pixels "
                             f"{settings.max_pixels}, which no image can be resized within; fix its "
                             "preprocessor_config.json")
        return settings

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def pixel_dim(self) -> int:
        """The width D of `pixel_values [N, D]`: one flattened patch (3 channels x temporal x patch x patch)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """`smart_resize`: both sides a multiple of `factor`, the area within [min_pixels, max_pixels], the aspect
        ratio kept as closely as that allows."""
        factor = self.factor
        if max(height, width) / min(height, width) > 200:
            raise ImageSizeError(f"an aspect ratio over 200 ({width}x{height}), which the processor refuses")
        h = round(height / factor) * factor
        w = round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def grid(self, height: int, width: int) -> Grid:
        """An image's `image_grid_thw` row (a still image is one temporal patch)."""
        h, w = self.resized(height, width)
        return (1, h // self.patch_size, w // self.patch_size)

    def tokens(self, grid: Grid) -> int:
        """The image tokens one image puts in the text: its patches merged `merge_size`**2 to one."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)

    # -- ImageFamily -------------------------------------------------------------------------------------------------

    def settings(self, sizes: Sequence[tuple[int, int]]) -> tuple[Setting, ...]:
        """Every image resized to one of 1 to 4 fixed sizes (`fixed_sizes`), or the processor's pixel limits set
        otherwise (`pixel_limits`), each taken from the images' own distribution."""
        out: list[Setting] = []
        for count in SIZE_COUNTS:
            fixed = self.fixed_sizes(sizes, count)
            if fixed and all(setting.sizes != fixed for setting in out):
                out.append(Setting(label=FixedSizes(fixed).label, family=self, apply=resize_line(fixed), sizes=fixed))
        for low, high in self.pixel_limits(sizes):
            label = f"min_pixels = max_pixels = {high:,}" if low == high else f"max_pixels {high:,}"
            apply = (f'"size": {{"shortest_edge": {low}, "longest_edge": {high}}}  (in the processor\'s '
                     "preprocessor_config.json)")
            out.append(Setting(label=label, family=replace(self, min_pixels=low, max_pixels=high), apply=apply,
                               pixel_limits=(low, high)))
        return tuple(out)

    def fixed_sizes(self, sizes: Sequence[tuple[int, int]], count: int) -> tuple[tuple[int, int], ...]:
        """`count` sizes taken from the images' own distribution: the images ordered by aspect ratio and cut into
        `count` groups of equal size, each group's size smart_resize's of its median height and width (a size it
        keeps as it is, so a resized image has exactly that grid)."""
        ordered = sorted(sizes, key=lambda size: size[1] / size[0])
        targets: list[tuple[int, int]] = []
        for part in range(count):
            group = ordered[part * len(ordered) // count:(part + 1) * len(ordered) // count]
            if not group:
                continue
            heights = sorted(h for h, _ in group)
            widths = sorted(w for _, w in group)
            target = self.resized(heights[len(heights) // 2], widths[len(widths) // 2])
            if target not in targets:
                targets.append(target)
        return tuple(targets)

    def pixel_limits(self, sizes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """(min_pixels, max_pixels) taken from the images' own distribution, as smart_resize resizes them now:
        max_pixels at the median and at the lower quartile of their areas (each cap below the current one; a
        multiple of the factor squared), and both limits at the median, which brings every image to about one
        area."""
        areas = sorted(h * w for h, w in (self.resized(h, w) for h, w in sizes))
        if not areas:
            return []
        square = self.factor * self.factor
        out: list[tuple[int, int]] = []
        for area in (areas[len(areas) // 2], areas[len(areas) // 4]):
            cap = max(square, area // square * square)
            if self.min_pixels <= cap < self.max_pixels and all(high != cap for _, high in out):
                out.append((self.min_pixels, cap))
        median = max(square, areas[len(areas) // 2] // square * square)
        out.append((median, median))
        return out

    def generation_refusal(self) -> str | None:
        return None  # one pixel tensor row (block) per image: TRL slices a micro-batch's by its images

    def image(self, height: int, width: int) -> ImageKey:
        return self.grid(height, width)

    def expansion(self, key: ImageKey, processor: Any) -> str:
        """The processor's `image_token` repeated once per merged patch (its own tokens are one token each)."""
        return str(processor.image_token) * self.tokens(_grid(key))

    def pixel_values(self, rows: Sequence[Sequence[ImageKey]]) -> tuple[int, ...]:
        return (pixel_rows([_grid(key) for row in rows for key in row]), self.pixel_dim)

    def inputs(self, rows: Sequence[Sequence[ImageKey]]) -> Inputs:
        return ()  # its image_grid_thw rows are the images' keys themselves

    def picture(self, key: ImageKey) -> tuple[int, int]:
        """The grid's own pixel size, which smart_resize keeps (where it is within the processor's limits)."""
        _, h, w = _grid(key)
        return h * self.patch_size, w * self.patch_size


def _whole(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1 \
            or value != int(value):
        raise ValueError(f"image processor has {name} {value!r}, not a whole number of at least 1; fix it in "
                         "its preprocessor_config.json")
    return int(value)


def _grid(key: ImageKey) -> Grid:
    t, h, w = key
    return t, h, w


def pixel_rows(grids: Sequence[Grid]) -> int:
    """N of `pixel_values [N, D]`: every image's patches, concatenated (TRL pads neither N nor the grids)."""
    return sum(t * h * w for t, h, w in grids)
