"""Compile-time estimates on one NeuronCore (measured on trn2 with Qwen3-0.6B; see docs/advise.md)."""

from __future__ import annotations

from .model import GENERATE_PHASES, Plan

TRAIN_SHAPE_MINUTES = 1.0
GENERATE_SHAPE_MINUTES = 12.0


def compile_minutes(plan: Plan, *, train_minutes: float = TRAIN_SHAPE_MINUTES,
                    generate_minutes: float = GENERATE_SHAPE_MINUTES) -> float:
    """Estimated minutes to compile every distinct shape of `plan` once."""
    keys = {s.key for s in plan.shapes}
    return sum(generate_minutes if key.phase in GENERATE_PHASES else train_minutes for key in keys)
