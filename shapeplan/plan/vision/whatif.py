"""Image what-ifs that hold for every family: every image resized to one of a few fixed sizes, and what a family's
setting keeps of the pixel values the vision tower would receive. Each family's own settings are its
`ImageFamily.settings`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .family import ImageFamily, Setting


@dataclass(frozen=True, slots=True)
class FixedSizes:
    """A few (height, width) sizes every image is resized to before training: the one with the nearest aspect
    ratio. Each is a size the family's processor keeps as it is (Qwen-VL's: a multiple of its factor within its pixel
    limits; LLaVA-NeXT's: a pinpoint), so each image then has one of `len(sizes)` keys."""

    sizes: tuple[tuple[int, int], ...]

    def target(self, height: int, width: int) -> tuple[int, int]:
        aspect = math.log(width / height)
        return min(self.sizes, key=lambda size: abs(math.log(size[1] / size[0]) - aspect))

    @property
    def label(self) -> str:
        """The sizes as height x width, the order of the (height, width) pairs `shapeplan.resize_images` takes."""
        shown = ", ".join(f"{h}x{w}" for h, w in self.sizes)
        return f"{len(self.sizes)} fixed size{'s' if len(self.sizes) > 1 else ''} ({shown})"


def fixed_sizes_of(setting: Setting | None) -> FixedSizes | None:
    """The fixed sizes a setting first resizes every image to, where it does."""
    return FixedSizes(setting.sizes) if setting is not None and setting.sizes else None


def resize_line(sizes: Sequence[tuple[int, int]]) -> str:
    """How a user applies fixed sizes: the dataset resized before training (`shapeplan.resize_images`)."""
    pairs = ", ".join(f"({h}, {w})" for h, w in sizes)
    return f"dataset = shapeplan.resize_images(dataset, [{pairs}])"


def pixels_kept_by(sizes: Sequence[tuple[int, int]], family: ImageFamily, setting: Setting) -> float:
    """The share of the pixel values the vision tower receives that a setting keeps, image by image (an image that
    would receive more keeps all of its own): each image's pixel tensor on its own, under the family as given and
    under the setting (its family, its images resized to one of its sizes)."""
    fixed = fixed_sizes_of(setting)
    before = after = 0
    for h, w in sizes:
        given = math.prod(family.pixel_values([[family.image(h, w)]]))
        th, tw = fixed.target(h, w) if fixed is not None else (h, w)
        before += given
        after += min(given, math.prod(setting.family.pixel_values([[setting.family.image(th, tw)]])))
    return after / before if before else 1.0
