"""Image what-ifs: fewer image sizes, other pixel limits; what each keeps of the pixels the processor would feed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .family import ImageFamily, Setting
from .qwen2_vl import ImageProcessing


@dataclass(frozen=True, slots=True)
class FixedSizes:
    """A few (height, width) sizes every image is resized to before training: the one with the nearest aspect
    ratio. Each is a size the processor keeps as it is (a multiple of its factor within its pixel limits), so each
    image then has one of `len(sizes)` grids."""

    sizes: tuple[tuple[int, int], ...]

    def target(self, height: int, width: int) -> tuple[int, int]:
        aspect = math.log(width / height)
        return min(self.sizes, key=lambda size: abs(math.log(size[1] / size[0]) - aspect))

    @property
    def label(self) -> str:
        """The sizes as height x width, the order of the (height, width) pairs `shapeplan.resize_images` takes."""
        shown = ", ".join(f"{h}x{w}" for h, w in self.sizes)
        return f"{len(self.sizes)} fixed size{'s' if len(self.sizes) > 1 else ''} ({shown})"


def fixed_sizes(sizes: Sequence[tuple[int, int]], count: int, processing: ImageProcessing) -> FixedSizes:
    """`count` sizes taken from the images' own distribution: the images ordered by aspect ratio and cut into
    `count` groups of equal size, each group's size the processor's resize of its median height and width."""
    ordered = sorted(sizes, key=lambda size: size[1] / size[0])
    targets: list[tuple[int, int]] = []
    for part in range(count):
        group = ordered[part * len(ordered) // count:(part + 1) * len(ordered) // count]
        if not group:
            continue
        heights = sorted(h for h, _ in group)
        widths = sorted(w for _, w in group)
        target = processing.resized(heights[len(heights) // 2], widths[len(widths) // 2])
        if target not in targets:
            targets.append(target)
    return FixedSizes(tuple(targets))


def pixels_kept(sizes: Sequence[tuple[int, int]], resize: FixedSizes, processing: ImageProcessing) -> float:
    """The share of the pixels the processor would feed that the fixed sizes keep (an upscaled image keeps all of
    its own and gains none)."""
    return _kept([processing.resized(h, w) for h, w in sizes], [resize.target(h, w) for h, w in sizes])


def _kept(before: Sequence[tuple[int, int]], after: Sequence[tuple[int, int]]) -> float:
    """The share of the `before` pixels that `after` keeps, image by image (an upscaled one keeps all of its own)."""
    total = sum(h * w for h, w in before)
    if not total:
        return 1.0
    return sum(min(bh * bw, ah * aw) for (bh, bw), (ah, aw) in zip(before, after, strict=True)) / total


@dataclass(frozen=True, slots=True)
class PixelLimits:
    """The processor's pixel limits set otherwise (`preprocessor_config.json` `size`: `shortest_edge` is min_pixels,
    `longest_edge` max_pixels): every image then resized within them, its aspect ratio kept."""

    min_pixels: int
    max_pixels: int

    def applied(self, processing: ImageProcessing) -> ImageProcessing:
        return replace(processing, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    @property
    def label(self) -> str:
        if self.min_pixels == self.max_pixels:
            return f"min_pixels = max_pixels = {self.max_pixels:,}"
        return f"max_pixels {self.max_pixels:,}"


def pixel_limits(sizes: Sequence[tuple[int, int]], processing: ImageProcessing) -> list[PixelLimits]:
    """Limits taken from the images' own distribution, as the processor resizes them now: max_pixels at the median
    and at the lower quartile of their areas (each cap below the current one; a multiple of the factor squared),
    and both limits at the median, which brings every image to about one area."""
    areas = sorted(h * w for h, w in (processing.resized(h, w) for h, w in sizes))
    if not areas:
        return []
    square = processing.factor * processing.factor
    out: list[PixelLimits] = []
    for area in (areas[len(areas) // 2], areas[len(areas) // 4]):
        cap = max(square, area // square * square)
        if processing.min_pixels <= cap < processing.max_pixels and all(o.max_pixels != cap for o in out):
            out.append(PixelLimits(min_pixels=processing.min_pixels, max_pixels=cap))
    median = max(square, areas[len(areas) // 2] // square * square)
    out.append(PixelLimits(min_pixels=median, max_pixels=median))
    return out


def pixels_kept_under(sizes: Sequence[tuple[int, int]], processing: ImageProcessing, limits: PixelLimits) -> float:
    """The share of the pixels the processor would feed that it keeps under `limits` (an upscaled image keeps all
    of its own and gains none)."""
    limited = limits.applied(processing)
    return _kept([processing.resized(h, w) for h, w in sizes], [limited.resized(h, w) for h, w in sizes])


def pixels_kept_by(sizes: Sequence[tuple[int, int]], family: ImageFamily, setting: Setting) -> float:
    """The share of the pixel values the vision tower receives that a setting keeps, image by image (an image that
    would receive more keeps all of its own): each image's pixel tensor on its own, under the family as given and
    under the setting (its family, its images resized to one of its sizes)."""
    fixed = FixedSizes(setting.sizes) if setting.sizes else None
    before = after = 0
    for h, w in sizes:
        given = math.prod(family.pixel_values([[family.image(h, w)]]))
        th, tw = fixed.target(h, w) if fixed is not None else (h, w)
        before += given
        after += min(given, math.prod(setting.family.pixel_values([[setting.family.image(th, tw)]])))
    return after / before if before else 1.0
