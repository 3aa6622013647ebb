"""Script mode: the run a user's training script builds (`shapeplan analyze|advise|warm -- python train.py ARGS`),
read from the trainer the script trains and planned by the method's own planner."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UsageError
from .trainers import TRAINERS

if TYPE_CHECKING:
    from ..adapters.script.command import ScriptCommand
    from ..adapters.trl_args import TrainingArgs


def script_args(command: ScriptCommand, *, use_cpu: bool = True) -> TrainingArgs:
    """Run `command`'s script up to the trainer it trains, and read the run from that trainer. `use_cpu`: build its
    configs for the CPU (planning anywhere); False where a warm-up on an accelerator needs the run's own device."""
    from ..adapters.script.capture import capture
    from ..adapters.script.run import training_args

    built = capture(command, use_cpu=use_cpu)
    spec = next((s for s in TRAINERS.values() if built.trainer_class.__module__.startswith("trl.")
                 and s.trainer_class == built.trainer_class.__name__), None)
    if spec is None:
        planned = ", ".join(s.trainer_class for s in TRAINERS.values())
        raise UsageError(f"{command.name} trains {built.described}, which shapeplan does not plan; it plans TRL's "
                         f"{planned}")
    return training_args(spec, built, command, use_cpu=use_cpu)
