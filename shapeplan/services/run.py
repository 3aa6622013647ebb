"""A run to warm or verify, as the command line names it: its plan (read from a plan file, or made from the run's
arguments), the arguments checked against the plan, and its warmer (`load_run`); and where it compiles
(`choose_backend`). The CLI's commands present what these return."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PlanFileError, UsageError

if TYPE_CHECKING:
    from ..adapters.script.command import ScriptCommand
    from ..adapters.trainer import TrainerSpec
    from ..plan.model import Plan
    from ..warm.backends.base import Backend
    from ..warm.runner import Warmer


# `accelerate launch` flags that say how to start the script, not how the run is set up: dropped with the wrapper
_SCRIPT_FLAGS = ("-m", "--module", "--no_python", "--no-python")


def unwrap_command(method: str | None, words: Sequence[str]) -> tuple[str | None, tuple[str, ...]]:
    """The run a wrapped training command line names, as `neuron_parallel_compile` takes one after `--`:
    `trl METHOD ARGS`, `accelerate launch LAUNCH... (trl METHOD | -m trl.scripts.METHOD | .../trl/scripts/METHOD.py)
    ARGS` or `python -m trl.scripts.METHOD ARGS` become METHOD and ARGS, followed by the launch options (`trl`
    passes those to `accelerate launch` the same way). Other words are returned as given. `method` is the
    `--method` given (None: not given), which must agree with the wrapped one."""
    from .trainers import METHODS

    words = list(words)
    head = Path(words[0]).name if words else ""
    if words == ["trl"] and not Path(words[0]).exists():  # `-- trl` alone; `trl --opt` may be a dataset named trl
        raise UsageError(f"`{words[0]}` names no training command; wrap one of "
                         f"{', '.join(f'`trl {m}`' for m in METHODS)} with its options, e.g. `-- trl sft --config "
                         "sft.yaml`")
    if head == "trl" and len(words) > 1 and not words[1].startswith("-"):
        if words[1] not in METHODS:
            raise UsageError(f"`trl {words[1]}` is not a training command shapeplan plans; wrap one of "
                             f"{', '.join(f'`trl {m}`' for m in METHODS)}")
        wrapped, argv = words[1], words[2:]
    elif head == "accelerate" and words[1:2] != ["launch"]:
        raise UsageError(f"`{' '.join(words[:2])}` starts no training run; wrap `accelerate launch [OPTIONS] "
                         "train.py ...` or `trl sft ...`")
    elif (head == "accelerate" and words[1:2] == ["launch"]) or head.startswith("python"):
        start = 2 if head == "accelerate" else 1
        for i in range(start, len(words)):
            found = _trl_script(words[i:], METHODS)
            if found is not None:
                wrapped, used = found
                launch = [w for w in words[start:i] if w not in _SCRIPT_FLAGS]
                argv = [*words[i + used:], *launch]
                break
        else:  # the user's own script: script mode (`script_command`)
            return method, tuple(words)
    else:
        return method, tuple(words)
    if method is not None and method != wrapped:
        raise UsageError(f"--method {method} disagrees with the wrapped `trl {wrapped}`; drop --method")
    return wrapped, tuple(argv)


def script_command(words: Sequence[str], *, method: str | None = None, model: str | None = None,
                   eval_dataset: str | None = None, split: str | None = None) -> ScriptCommand | None:
    """The user's training script `words` run (after `unwrap_command`: no TRL command), or None. The script names
    its data, model and trainer: options that would name them too are refused."""
    from ..adapters.script.command import is_script_command, parse_command

    if not is_script_command(words):
        return None
    named = [label for label, value in (("--method", method), ("--model", model), ("--eval-dataset", eval_dataset),
                                        ("--split", split)) if value is not None]
    if named:
        raise UsageError(f"{named[0]} is given with a training script, which builds its own trainer, model and data; "
                         f"drop {named[0]} (shapeplan plans what the script builds)")
    return parse_command(words)


def _trl_script(words: list[str], methods: Sequence[str]) -> tuple[str, int] | None:
    """The method of the TRL script `words` start with and how many words name it, or None."""
    first = words[0]
    if Path(first).name == "trl" and words[1:2] and words[1] in methods:  # the `trl` console script
        return words[1], 2
    module = first.removeprefix("trl.scripts.")
    if module != first and module in methods:
        return module, 1
    path = Path(first)
    if path.suffix == ".py" and path.stem in methods and path.parent.parts[-2:] == ("trl", "scripts"):
        return path.stem, 1
    return None


def device_argv(argv: list[str], device: str) -> list[str]:
    """Training on an accelerator needs `use_cpu` off (argument parsing turns it on to plan anywhere)."""
    from ..adapters.trl_args import given_options

    if device == "cpu" or "use_cpu" in given_options(argv):
        return argv
    return ["--use_cpu", "false", *argv]


def check_config(plan: Plan, args: Any, planned: Any, names: set[str]) -> None:
    """The options named on the command line (`names`, TRL field names) must have the values the plan was made
    with (`planned`: the plan's own arguments, parsed; its recorded config first); the plan supplies every option
    not named."""
    given, made = _settings(args), {**_settings(planned), **plan.config}
    # the model first: with another model every other difference is beside the point
    for name in sorted(names & set(given), key=lambda item: (item != "model_name_or_path", item)):
        if name == "argv" or name not in made or _same(made[name], given[name]):
            continue
        raise PlanFileError(f"the plan was made for {name}={made[name]!r}, but this run has {given[name]!r}; "
                            "re-create the plan with `shapeplan analyze ... -o PLAN` for this run",
                            field=name, planned=made[name], given=given[name])


def _settings(args: Any) -> dict[str, Any]:
    """Every TRL option of a parsed run, by field name, and its tools, environment and rollout function as the plan
    records them, as JSON values (the recorded config's where it has them)."""
    import dataclasses

    from ..adapters.common import recorded_config

    fields = {f.name: getattr(part, f.name) for part in (args.script, args.model, args.training)
              for f in dataclasses.fields(part)}
    return json.loads(json.dumps({**fields, **args.agentic.recorded(), **recorded_config(args, [])}, default=str))


def _same(planned: Any, given: Any) -> bool:
    """Equal values, or two names of one existing file or folder (a dataset or model named another way)."""
    if planned == given:
        return True
    return (isinstance(planned, str) and isinstance(given, str) and Path(planned).exists()
            and Path(planned).resolve() == Path(given).resolve())


def load_run(plan_path: str | None, method: str | None, model: str | None, eval_dataset: str | None, split: str | None,
             trl_args: tuple[str, ...], device: str) -> tuple[Plan, Warmer[Any]]:
    """The plan (read, or made from the run's arguments) and the warmer for the run `analyze` plans (with no
    training option, the guide's example). With a plan, options given on the command line are checked against it
    and the plan's own arguments supply the rest (and the method: `method` names it for a run without a plan, None
    for the default one). The warmer comes first: a run it cannot warm is refused before
    planning, and before any model loads."""
    from ..adapters.data import check_weight_files
    from ..adapters.grpo import with_guide_example
    from ..adapters.script.command import is_script_command
    from ..adapters.trl_args import given_options, parse_training_args, split_run_arguments
    from ..plan.io import load_plan
    from ..warm.identity import check_plan_fits_model
    from ..warm.parallel import current_part
    from .analyze import analyze
    from .trainers import DEFAULT_METHOD, trainer_spec

    current_part()  # RANK/WORLD_SIZE checked before TRL's parser reads them (it would blame the plan's options)
    plan = None
    named: set[str] = set()
    if plan_path is not None:
        plan = load_plan(plan_path)
    if is_script_command(trl_args) or (plan is not None and "command" in plan.config and not trl_args):
        return _script_run(plan, plan_path, trl_args, device)
    if plan is not None and plan_path is not None:
        if method is not None and method != plan.method:
            raise PlanFileError(f"the plan is for {plan.method}, but --method {method} is given; drop --method (the "
                                f"plan names it) or re-create the plan with `shapeplan analyze --method {method}`")
        if eval_dataset is not None:
            raise UsageError("--eval-dataset names the eval data to plan, and the plan holds its eval shapes; drop "
                             "--eval-dataset, or re-create the plan with it")
        spec = trainer_spec(plan.method)
        check_warmable(spec, plan)
        planned = _planned_args(spec, plan, plan_path, device)
        given = split_run_arguments(spec, trl_args, model, split)
        named = given_options(given)
        argv = [*plan.config.get("argv", []), *given]  # argparse keeps an option's last value: the given one
    else:
        spec = trainer_spec(method or DEFAULT_METHOD)
        argv = split_run_arguments(spec, trl_args, model, split)
    run_argv = device_argv(argv, device)
    if plan is not None and not named:
        args = planned  # the plan's own arguments, parsed and checked once
    else:
        parsed = parse_training_args(spec, run_argv)
        args, _ = with_guide_example(parsed, run_argv)
    check_weight_files(args.model.model_name_or_path)  # warm loads the weights; a cut file fails every shape
    warmer = spec.warmer(args)
    if plan is None:
        # parsed once: planning reads the run as parsed unless the device turned `use_cpu` off, which planning
        # keeps on to run anywhere
        plan = analyze(spec.name, argv, eval_source=eval_dataset, parsed=parsed if run_argv == argv else None)
        check_warmable(spec, plan)  # a plan file's is checked as it is read
    elif named:
        check_config(plan, args, planned, named)
    check_plan_fits_model(plan, args, warmer)
    return plan, warmer


def _script_run(plan: Plan | None, plan_path: str | None, words: Sequence[str], device: str
                ) -> tuple[Plan, Warmer[Any]]:
    """`load_run` for a training script (script mode): the run its trainer holds, built for `device`; with a plan
    made from a script and no command given, the plan's recorded command is re-run for the script's objects."""
    from ..adapters.data import check_weight_files
    from ..adapters.script.command import parse_command
    from ..warm.identity import check_plan_fits_model
    from .analyze import plan_parsed
    from .script import script_args

    recorded = plan.config.get("command") if plan is not None else None
    if plan is not None and recorded is None:
        raise PlanFileError(f"plan {plan_path} was made from TRL options, not a script; warm it with `shapeplan warm "
                            "--plan PLAN` alone, or re-create it with `shapeplan analyze -o PLAN -- python train.py`")
    if recorded is not None and not (isinstance(recorded, list) and recorded and
                                     all(isinstance(word, str) for word in recorded)):
        raise PlanFileError(f"plan {plan_path}: config.command must be the script's command as a list of strings, "
                            f"got {recorded!r}; re-create it with `shapeplan analyze -o PLAN -- python train.py`")
    words = list(words) or list(recorded or [])
    if recorded is not None and words != recorded:
        raise PlanFileError(f"plan {plan_path} was made from `{shlex.join(recorded)}`, not `{shlex.join(words)}`; "
                            "give the same command, or re-create the plan from this one")
    # planning resolves the configs for the CPU; a warm-up on an accelerator needs the run's own device setting
    args = script_args(parse_command(words), use_cpu=device == "cpu")
    check_weight_files(args.model.model_name_or_path)  # warm loads the weights; a cut file fails every shape
    warmer = args.spec.warmer(args)
    if plan is None:
        plan = plan_parsed(args)
    elif plan.method != args.method:
        trainer = args.objects.trainer if args.objects is not None else args.method
        raise PlanFileError(f"plan {plan_path} is for {plan.method}, but the script trains {trainer}; re-create the "
                            "plan from the script")
    check_warmable(args.spec, plan)
    check_plan_fits_model(plan, args, warmer)
    return plan, warmer


def check_warmable(spec: TrainerSpec, plan: Plan) -> None:
    """Refuse what warm cannot drive, a plan file's before its arguments are parsed (a GRPO plan without its reward
    function is refused for what warm cannot do at all): vision batches but where the method's warmer feeds them."""
    if not spec.warm_images and any(s.pixel_values is not None for s in plan.shapes):
        raise PlanFileError(f"the plan has vision batches (pixel_values), which warm feeds for SFT only, not yet "
                            f"for {plan.method}: warming only their text would leave every vision-tower graph cold; "
                            "plan and guard the run, and let the first epoch compile them")


def plan_tasks(plan_path: str, device: str, method: str | None = None, model: str | None = None,
               eval_dataset: str | None = None, split: str | None = None,
               trl_args: tuple[str, ...] = ()) -> list[Any]:
    """The plan's warm-up tasks (their keys name its shapes in manifests), as `warm` would run them."""
    plan, warmer = load_run(plan_path, method, model, eval_dataset, split, trl_args, device)
    warmer.bind(plan)
    return list(warmer.tasks(plan))


def _planned_args(spec: TrainerSpec, plan: Plan, path: str, device: str) -> Any:
    """The plan's own arguments, parsed, with its recorded config checked as a command line's options are."""
    from ..adapters.generation import refuse_unplannable
    from ..adapters.grpo import with_guide_example
    from ..adapters.trl_args import check_recorded, parse_training_args

    argv = device_argv(list(plan.config.get("argv", [])), device)
    try:
        planned, _ = with_guide_example(parse_training_args(spec, argv), argv)
        if spec.generates:  # what `analyze` refuses of such a run, in a hand-edited argv too
            refuse_unplannable(planned)
        check_recorded(planned, plan.config)
    except UsageError as exc:
        raise PlanFileError(f"plan {path}: {exc}; re-create it with `shapeplan analyze -o PLAN`") from exc
    return planned


def choose_backend(device: str | None, cache_dir: str | None) -> tuple[Backend, Path]:
    """The backend for `device` (default: the best available) and the cache dir it names, as given."""
    from ..warm.backends import default_device, make_backend
    from ..warm.cachedir import cache_dir_path, default_cache_dir

    device = device or default_device()
    return make_backend(device), cache_dir_path(Path(cache_dir) if cache_dir else default_cache_dir(device))
