"""shapeplan: plan and pre-compile every input shape a TRL run feeds the model on AWS Trainium.

The planning core (`shapeplan.plan`) is pure Python; TRL, transformers, datasets and torch are imported
only by `shapeplan.adapters` and `shapeplan.warm`, and only when a command needs them.
"""

from __future__ import annotations

from .errors import ShapeplanError
from .plan.io import PLAN_SCHEMA, load_plan, plan_from_dict, plan_to_dict, write_plan
from .plan.model import Plan, PlanStats, Shape

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # ShapeGuard is a transformers TrainerCallback: imported on first use, so `import shapeplan` stays light
    if name == "ShapeGuard":
        from .guard.callback import ShapeGuard

        return ShapeGuard
    raise AttributeError(f"module 'shapeplan' has no attribute {name!r}")

__all__ = [
    "PLAN_SCHEMA",
    "Plan",
    "PlanStats",
    "Shape",
    "ShapeGuard",
    "ShapeplanError",
    "__version__",
    "load_plan",
    "plan_from_dict",
    "plan_to_dict",
    "write_plan",
]
