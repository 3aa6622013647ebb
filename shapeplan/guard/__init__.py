"""The guard: a real TRL run checks itself against its plan before each forward and records what it met
(`ShapeGuard`, `shapeplan guard`). `ShapeGuard` imports transformers, so it is loaded on first use."""

from __future__ import annotations

from .modes import MODES


def __getattr__(name: str) -> object:
    if name == "ShapeGuard":
        from .callback import ShapeGuard

        return ShapeGuard
    raise AttributeError(f"module 'shapeplan.guard' has no attribute {name!r}")


__all__ = ["MODES", "ShapeGuard"]
