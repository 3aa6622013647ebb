"""`shapeplan warm`: compile every planned shape before training, through the trainer's real step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..errors import PlanFileError, UsageError
from ..warm.backends import DEVICES
from .analyze import run_options, split_run_arguments


def device_option(command):  # type: ignore[no-untyped-def]
    command = click.option("--cache-dir", "cache_dir", type=click.Path(file_okay=False), default=None,
                           metavar="DIR", help="Persistent compile cache (TORCH_NEURONX_NEFF_CACHE_DIR on neuron, "
                           "TORCHINDUCTOR_CACHE_DIR on cpu/cuda). Default: ~/.cache/shapeplan/<stack> "
                           "($SHAPEPLAN_CACHE_DIR overrides the root).")(command)
    command = click.option("--device", type=click.Choice(DEVICES), default=None,
                           help="Where to compile. Default: neuron if torch-neuronx is installed, else cuda if "
                           "available, else cpu.")(command)
    command = click.option("--json", "as_json", is_flag=True,
                           help="Print a machine-readable report on stdout.")(command)
    return command


def prepare(device: str | None, cache_dir: str | None) -> tuple[Any, Path]:
    """The backend and cache dir, set up before torch is imported (backends read env vars at import)."""
    from ..warm.backends import default_device, make_backend
    from ..warm.runner import check_cache_dir, default_cache_dir

    device = device or default_device()
    backend = make_backend(device)
    cache = check_cache_dir(Path(cache_dir) if cache_dir else default_cache_dir(device))
    backend.prepare(cache)
    # stderr carries the per-shape rows: keep the libraries' own progress bars and notices off it
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return backend, cache


def device_argv(argv: list[str], device: str) -> list[str]:
    """Training on an accelerator needs `use_cpu` off (argument parsing turns it on to plan anywhere)."""
    from ..adapters.trl_args import given_options

    if device == "cpu" or "use_cpu" in given_options(argv):
        return argv
    return ["--use_cpu", "false", *argv]


def check_config(plan: Any, args: Any, argv: list[str]) -> None:
    """The run described on the command line must be the one the plan was made for."""
    from ..adapters.common import recorded_config

    given = json.loads(json.dumps(recorded_config(args, argv), default=str))
    # the model first: with another model every other difference is beside the point
    for name, value in sorted(given.items(), key=lambda item: (item[0] != "model_name_or_path", item[0])):
        if name == "argv" or name not in plan.config:
            continue
        if plan.config[name] != value:
            raise PlanFileError(f"the plan was made for {name}={plan.config[name]!r}, but this run has {value!r}; "
                                "re-create the plan with `shapeplan analyze ... -o PLAN` for this run")


def load_run(plan_path: str | None, method: str, model: str | None, eval_dataset: str | None, split: str | None,
             trl_args: tuple[str, ...], device: str) -> tuple[Any, Any]:
    """The plan (read, or made from the run's arguments) and the run's parsed arguments."""
    from ..adapters.trl_args import parse_training_args
    from ..analyze import analyze
    from ..plan.io import load_plan

    described = bool(trl_args or model or split or eval_dataset)
    if plan_path is not None:
        plan = load_plan(plan_path)
        argv = split_run_arguments(plan.method, trl_args, model, split) if described else \
            list(plan.config.get("argv", []))
    else:
        argv = split_run_arguments(method, trl_args, model, split)
        plan = analyze(method, argv, eval_source=eval_dataset)
    args = parse_training_args(plan.method, device_argv(argv, device))
    if plan_path is not None and described:
        check_config(plan, args, argv)
    return plan, args


def render(report: Any, *, verify: bool) -> str:
    from ..warm.runner import result_row

    lines = [result_row(r) for r in report.results]
    summary = report.to_dict()["summary"]
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in summary.items() if n) + f"  (cache: {report.cache_dir})")
    if verify:
        lines.append("verify: nothing compiled" if not report.compiled and not report.failed else
                     f"verify: {len(report.compiled)} shape(s) compiled, {len(report.failed)} failed")
    lines += [f"warning: {w}" for w in report.warnings]
    if report.script_lines:
        lines.append("")
        lines.append("Set these in the training script (and its environment) to hit this cache:")
        lines += [f"  {line}" for line in report.script_lines]
    return "\n".join(lines)


def emit(report: Any, *, as_json: bool, verify: bool) -> None:
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(render(report, verify=verify))
    if report.failed or (verify and report.compiled):
        raise click.exceptions.Exit(1)


@click.command("warm", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True})
@run_options
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None, metavar="PLAN",
              help="Warm this plan (from `shapeplan analyze -o`) instead of planning the run first.")
@device_option
@click.option("--workers", type=int, default=1, show_default=True, metavar="N",
              help="Warm in N processes at once, each on its share of the shapes (on neuron: its own NeuronCore), "
              "capped by host memory.")
@click.option("--worker-memory-gib", "worker_memory", type=click.FloatRange(min=0.1), default=None, metavar="GIB",
              help="Host memory one worker needs (default: 24 on neuron, 8 on cuda, 2 on cpu).")
def warm_command(method: str, model: str | None, eval_dataset: str | None, split: str | None,
                 trl_args: tuple[str, ...], plan_path: str | None, device: str | None, cache_dir: str | None,
                 as_json: bool, workers: int, worker_memory: float | None) -> None:
    """Compile every planned shape into a persistent cache before training.

    Builds the real TRL trainer from the run's config and model and runs its training step (forward, backward,
    optimizer step) and eval step on synthetic rows of each planned shape. Shapes already in the cache dir's
    manifest are skipped, so an interrupted warm-up resumes. Exit code 1 if any shape failed.

    \b
    Examples:
      shapeplan warm --plan plan.json
      shapeplan warm data.jsonl --model ./my-model --max_length 2048 --cache-dir /var/cache/shapeplan
      shapeplan warm --plan grpo-plan.json --workers 4
      accelerate launch --num_processes 2 -m shapeplan warm --plan dp-grpo-plan.json
    """
    from ..warm.runner import make_warmer, warm

    from ..warm.parallel import worker_count

    backend, cache = prepare(device, cache_dir)
    plan, args = load_run(plan_path, method, model, eval_dataset, split, trl_args, backend.device)
    count = worker_count(workers, backend.device, worker_memory)
    if count > 1 and int(plan.config.get("num_processes", 1)) > 1:
        raise UsageError("a data-parallel plan is warmed under `accelerate launch` with its number of processes, "
                         "whose ranks share the shapes; drop --workers")
    if count > 1:
        report = _warm_in_workers(plan, count, backend.device, cache)
    else:
        warmer = make_warmer(plan.method, args)
        report = warm(plan, warmer, backend, cache, progress=True)
    emit(report, as_json=as_json, verify=False)


def _warm_in_workers(plan: Any, count: int, device: str, cache: Path) -> Any:
    """The plan, written for the workers to read, warmed by `count` worker processes."""
    import tempfile

    from ..plan.io import write_plan
    from ..warm.parallel import run_workers

    with tempfile.TemporaryDirectory(prefix="shapeplan-workers-") as folder:
        plan_file = Path(folder) / "plan.json"
        write_plan(plan, plan_file)
        return run_workers(plan_file, count=count, device=device, cache_dir=cache)
