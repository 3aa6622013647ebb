"""`advise` for a vision-language run: its vision graphs as given, and what-ifs that resize every image to one of
a few fixed sizes, or set the processor's pixel limits, each taken from the dataset's own distribution and each an
exact plan of the same rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import DatasetError
from ..plan.cost import compile_minutes
from ..plan.io import shape_to_dict
from ..plan.model import Plan
from ..plan.vision import (
    FixedSizes,
    ImageProcessing,
    PixelLimits,
    fixed_sizes,
    pixel_limits,
    pixels_kept,
    pixels_kept_by,
    pixels_kept_under,
)
from ..plan.vision.family import ImageFamily, Setting

SIZE_COUNTS = (1, 2, 3, 4)  # how many fixed sizes each what-if allows


@dataclass(frozen=True)
class VisionOption:
    sizes: FixedSizes | None  # None: the images as they are
    plan: Plan
    pixels_kept: float  # of the pixels the processor feeds as given
    limits: PixelLimits | None = None  # the processor's pixel limits set otherwise
    setting: Setting | None = None  # a setting of the family's that fixes its graphs

    @property
    def compile_minutes(self) -> float:
        return compile_minutes(self.plan)

    @property
    def label(self) -> str:
        if self.setting is not None:
            return self.setting.label
        return self.sizes.label if self.sizes is not None else self.limits.label if self.limits is not None else \
            "(as given)"


@dataclass(frozen=True)
class VisionAdvice:
    method: str
    baseline: VisionOption
    options: tuple[VisionOption, ...]  # fewest compile minutes first

    @property
    def best(self) -> VisionOption | None:
        """The what-if that compiles least, where it compiles less than the run as given."""
        best = self.options[0] if self.options else None
        return best if best is not None and best.compile_minutes < self.baseline.compile_minutes else None


class ImageRun(Protocol):
    """A vision-language run read once (`adapters.sft.VisionRun`, `adapters.grpo.GenerationRun`)."""

    @property
    def processing(self) -> ImageFamily: ...

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """Every train image's (height, width), as the processor receives it."""
        ...

    def plan(self, resize: FixedSizes | None = None, limits: PixelLimits | None = None,
             family: ImageFamily | None = None) -> Plan:
        """Its plan, as given or under a what-if: every image resized to one of `resize`, pixel limits, or the
        processor's family under other settings."""
        ...


def advise_vision(method: str, run: ImageRun, counts: Sequence[int] = SIZE_COUNTS) -> VisionAdvice:
    """The run as given and its what-ifs, each an exact plan of the same rows."""
    processing, sizes, plan = run.processing, run.sizes, run.plan
    baseline = VisionOption(sizes=None, plan=plan(), pixels_kept=1.0)
    options: list[VisionOption] = []
    if not isinstance(processing, ImageProcessing):  # the size what-ifs below resize as Qwen-VL's processor does
        for setting in processing.settings():
            resize = FixedSizes(setting.sizes) if setting.sizes else None
            options.append(VisionOption(sizes=resize, setting=setting,
                                        plan=plan(resize, family=setting.family if setting.family != processing
                                                  else None),
                                        pixels_kept=pixels_kept_by(sizes, processing, setting)))
        options.sort(key=lambda option: (option.compile_minutes, -option.pixels_kept))
        return VisionAdvice(method=method, baseline=baseline, options=tuple(options))
    for count in counts:
        fixed = fixed_sizes(sizes, count, processing)
        if not fixed.sizes or any(option.sizes == fixed for option in options):
            continue
        options.append(VisionOption(sizes=fixed, plan=plan(fixed),
                                    pixels_kept=pixels_kept(sizes, fixed, processing)))
    for limits in pixel_limits(sizes, processing):
        try:
            limited = plan(limits=limits)
        except DatasetError:  # more image tokens than max_length holds: a what-if TRL's forward would fail on
            continue
        options.append(VisionOption(sizes=None, limits=limits, plan=limited,
                                    pixels_kept=pixels_kept_under(sizes, processing, limits)))
    options.sort(key=lambda option: (option.compile_minutes, -option.pixels_kept))
    return VisionAdvice(method=method, baseline=baseline, options=tuple(options))


def apply_line(option: VisionOption) -> str:
    if option.setting is not None:
        return option.setting.apply
    if option.limits is not None:
        return (f'"size": {{"shortest_edge": {option.limits.min_pixels}, "longest_edge": '
                f'{option.limits.max_pixels}}}  (in the processor\'s preprocessor_config.json)')
    assert option.sizes is not None
    pairs = ", ".join(f"({h}, {w})" for h, w in option.sizes.sizes)
    return f"dataset = shapeplan.resize_images(dataset, [{pairs}])"


def vision_advice_to_dict(advice: VisionAdvice) -> dict[str, Any]:
    def option(o: VisionOption) -> dict[str, Any]:
        return {"option": o.label, "sizes": [list(size) for size in o.sizes.sizes] if o.sizes else None,
                "pixel_limits": None if o.limits is None else {"min_pixels": o.limits.min_pixels,
                                                               "max_pixels": o.limits.max_pixels},
                "vision_graphs": o.plan.vision_graphs, "distinct_shapes": o.plan.distinct_shapes,
                "compile_minutes": round(o.compile_minutes, 3), "pixels_kept": round(o.pixels_kept, 6),
                "shapes": [shape_to_dict(s, o.plan.config) for s in o.plan.shapes]}

    best = advice.best
    return {"method": advice.method, "vision": True, "baseline": option(advice.baseline),
            "options": [option(o) for o in advice.options],
            "recommended": None if best is None else {"option": best.label, "apply": apply_line(best)}}
