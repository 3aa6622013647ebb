"""`advise` for a vision-language run: its vision graphs as given, and the what-ifs its family's settings give (fixed
image sizes, pixel limits taken from the dataset's own distribution; pan-and-scan off, one frame per image, ...),
each an exact plan of the same rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import DatasetError
from ..plan.cost import compile_minutes
from ..plan.io import shape_to_dict
from ..plan.model import Plan
from ..plan.vision import pixels_kept_by
from ..plan.vision.family import ImageFamily, Setting


@dataclass(frozen=True)
class VisionOption:
    plan: Plan
    pixels_kept: float  # of the pixels the processor feeds as given
    setting: Setting | None = None  # a setting of the family's that fixes its graphs; None: the run as given

    @property
    def compile_minutes(self) -> float:
        return compile_minutes(self.plan)

    @property
    def label(self) -> str:
        return self.setting.label if self.setting is not None else "(as given)"


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

    def plan(self, setting: Setting | None = None) -> Plan:
        """Its plan, as given or under one of its family's settings (its images resized to the setting's sizes, the
        processor's family under the setting)."""
        ...


def advise_vision(method: str, run: ImageRun) -> VisionAdvice:
    """The run as given and its family's what-ifs, each an exact plan of the same rows (a what-if under which a row
    no longer fits, as TRL's forward would fail on it, left out)."""
    processing, sizes = run.processing, run.sizes
    options: list[VisionOption] = []
    for setting in processing.settings(sizes):
        try:
            plan = run.plan(setting)
        except DatasetError:  # more image tokens than max_length holds
            continue
        options.append(VisionOption(setting=setting, plan=plan, pixels_kept=pixels_kept_by(sizes, processing, setting)))
    options.sort(key=lambda option: (option.compile_minutes, -option.pixels_kept))
    return VisionAdvice(method=method, baseline=VisionOption(plan=run.plan(), pixels_kept=1.0), options=tuple(options))


def vision_advice_to_dict(advice: VisionAdvice) -> dict[str, Any]:
    def option(o: VisionOption) -> dict[str, Any]:
        sizes = o.setting.sizes if o.setting is not None else ()
        limits = o.setting.pixel_limits if o.setting is not None else None
        return {"option": o.label, "sizes": [list(size) for size in sizes] if sizes else None,
                "pixel_limits": None if limits is None else {"min_pixels": limits[0], "max_pixels": limits[1]},
                "vision_graphs": o.plan.vision_graphs, "distinct_shapes": o.plan.distinct_shapes,
                "compile_minutes": round(o.compile_minutes, 3), "pixels_kept": round(o.pixels_kept, 6),
                "shapes": [shape_to_dict(s, o.plan.config) for s in o.plan.shapes]}

    best = advice.best
    return {"method": advice.method, "vision": True, "baseline": option(advice.baseline),
            "options": [option(o) for o in advice.options],
            "recommended": None if best is None or best.setting is None else {"option": best.label,
                                                                              "apply": best.setting.apply}}
