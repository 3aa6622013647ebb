"""shapeplan: plan and pre-compile every input shape a TRL run feeds the model on AWS Trainium.

The public API: the plan types and file functions; `analyze(method, argv)`, a run's plan as `shapeplan analyze`
makes it; `analyze_script(["python", "train.py", ...])`, the plan of the run a training script builds;
`ShapeGuard`, the callback that checks a real run against its plan; `resize_images(dataset, sizes)`,
the `datasets.map` step that gives a vision dataset the few image sizes `shapeplan advise` proposes;
`pad_tool_turns(trainer)`, which makes an agentic run's tool turns generate on the round's rows (as a plan of a
run with tools has them, unless made with `--pad_tool_turns false`). The planning core (`shapeplan.plan`) is pure
Python; TRL, transformers, datasets and torch are imported only inside the functions that need them.
"""

from __future__ import annotations

from .errors import ShapeplanError
from .plan.io import PLAN_SCHEMA, load_plan, plan_from_dict, plan_to_dict, write_plan
from .plan.model import Plan, PlanStats, Shape

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # imported on first use, so that `import shapeplan` stays light (ShapeGuard is a transformers TrainerCallback)
    if name == "ShapeGuard":
        from .guard.callback import ShapeGuard

        return ShapeGuard
    if name == "analyze":
        from .services.analyze import analyze

        return analyze
    if name == "analyze_script":
        from .services.analyze import analyze_script

        return analyze_script
    if name == "pad_tool_turns":
        from .adapters.tool_turns import pad_tool_turns

        return pad_tool_turns
    if name == "resize_images":
        from .adapters.vision import resize_images

        return resize_images
    raise AttributeError(f"module 'shapeplan' has no attribute {name!r}")

__all__ = [
    "PLAN_SCHEMA",
    "Plan",
    "PlanStats",
    "Shape",
    "ShapeGuard",
    "ShapeplanError",
    "__version__",
    "analyze",
    "analyze_script",
    "load_plan",
    "pad_tool_turns",
    "plan_from_dict",
    "plan_to_dict",
    "resize_images",
    "write_plan",
]
