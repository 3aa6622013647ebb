"""`shapeplan warm`: compile every planned shape before training, through the trainer's real step."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from ..errors import PlanFileError, ShapeplanError, UsageError
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
    """The backend and cache dir, set up before torch is imported (backends read env vars at import). The dir is
    created (`check_cache_dir`) only once the run is known to be valid: a refused command leaves none behind."""
    from ..cache.archive import refuse_incomplete_import
    from ..warm.cachedir import check_cache_dir_can_exist

    backend, cache = choose_backend(device, cache_dir)
    check_cache_dir_can_exist(cache)
    refuse_incomplete_import(cache)
    backend.prepare(cache)
    quiet_libraries()
    return backend, cache


def choose_backend(device: str | None, cache_dir: str | None) -> tuple[Any, Path]:
    """The backend for `device` (default: the best available) and the cache dir it names, as given."""
    from ..warm.backends import default_device, make_backend
    from ..warm.cachedir import default_cache_dir

    device = device or default_device()
    return make_backend(device), (Path(cache_dir) if cache_dir else default_cache_dir(device)).resolve()


def quiet_libraries() -> None:
    """stderr carries the per-shape rows: keep the libraries' own progress bars and notices off it."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@contextlib.contextmanager
def refused_leaves_no_cache_dir(cache: Path) -> Iterator[None]:
    """Importing torch creates the compile cache dir named in its environment, before the run is known to be
    valid: a refused command removes it again if it made it and nothing was written into it."""
    existed = cache.exists()
    try:
        yield
    except ShapeplanError:
        if not existed:
            for folder in sorted((p for p in [cache, *cache.rglob("*")] if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):  # not empty: keep it
                    folder.rmdir()
        raise


def device_argv(argv: list[str], device: str) -> list[str]:
    """Training on an accelerator needs `use_cpu` off (argument parsing turns it on to plan anywhere)."""
    from ..adapters.trl_args import given_options

    if device == "cpu" or "use_cpu" in given_options(argv):
        return argv
    return ["--use_cpu", "false", *argv]


def check_config(plan: Any, args: Any, names: set[str]) -> None:
    """The options named on the command line (`names`, TRL field names) must have the values the plan was made
    with; the plan supplies every option not named."""
    from ..adapters.common import recorded_config

    given = json.loads(json.dumps(recorded_config(args, []), default=str))
    # the model first: with another model every other difference is beside the point
    for name in sorted(names & set(given), key=lambda item: (item != "model_name_or_path", item)):
        if name == "argv" or name not in plan.config:
            continue
        if plan.config[name] != given[name]:
            raise PlanFileError(f"the plan was made for {name}={plan.config[name]!r}, but this run has "
                                f"{given[name]!r}; re-create the plan with `shapeplan analyze ... -o PLAN` for this "
                                "run", field=name, planned=plan.config[name], given=given[name])


def load_run(plan_path: str | None, method: str, model: str | None, eval_dataset: str | None, split: str | None,
             trl_args: tuple[str, ...], device: str) -> tuple[Any, Any]:
    """The plan (read, or made from the run's arguments) and the warmer for the run `analyze` plans (with no
    training option, the guide's example). With a plan, options given on the command line are checked against it
    and the plan's own arguments supply the rest. The warmer comes first: a run it cannot warm is refused before
    planning, and before any model loads."""
    from ..adapters.grpo import with_guide_example
    from ..adapters.trl_args import given_options, parse_training_args
    from ..analyze import analyze
    from ..plan.io import load_plan
    from ..warm.identity import check_plan_fits_model
    from ..warm.runner import make_warmer

    plan = None
    named: set[str] = set()
    if plan_path is not None:
        plan = load_plan(plan_path)
        method = plan.method
        given = split_run_arguments(method, trl_args, model, split)
        named = given_options(given)
        argv = [*plan.config.get("argv", []), *given]  # argparse keeps an option's last value: the given one
    else:
        argv = split_run_arguments(method, trl_args, model, split)
    run_argv = device_argv(argv, device)
    args, _ = with_guide_example(parse_training_args(method, run_argv), run_argv)
    warmer = make_warmer(method, args)
    if plan is None:
        plan = analyze(method, argv, eval_source=eval_dataset)
    elif named:
        check_config(plan, args, named)
    check_plan_fits_model(plan, args)
    return plan, warmer


def render(report: Any, *, verify: bool) -> str:
    from ..warm.tracker import result_row

    lines = [result_row(r) for r in report.results]
    summary = report.to_dict()["summary"]
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in summary.items() if n) + f"  (cache: {report.cache_dir})")
    if report.shard:
        lines.append(f"shard {report.shard.label} (from {report.shard.source})")
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
              help="Warm in N processes at once, each on its share of the shapes (on neuron: its own NeuronCore, "
              "within NEURON_RT_VISIBLE_CORES when set), capped by host memory and the visible NeuronCores.")
@click.option("--worker-memory-gib", "worker_memory", type=click.FloatRange(min=0.1), default=None, metavar="GIB",
              help="Host memory one worker needs (default: 24 on neuron, 8 on cuda, 2 on cpu).")
@click.option("--shard", "shard_option", default=None, metavar="I/N",
              help="Warm shard I of N (from 0) of the plan's shapes, into its own manifest file; default: from "
              "SLURM_ARRAY_TASK_ID, JOB_COMPLETION_INDEX or AWS_BATCH_JOB_ARRAY_INDEX. See docs/fleet.md.")
@click.option("--shard-count", type=int, default=None, metavar="N",
              help="The shard count of a Kubernetes Indexed Job (JOB_COMPLETION_INDEX comes without one).")
@click.option("--status", is_flag=True,
              help="Warm nothing: show, from every manifest in the cache dir, which shapes are done (by which shard, "
              "in which environment) and which are missing. Exit 0 only when the plan is complete.")
def warm_command(method: str, model: str | None, eval_dataset: str | None, split: str | None,
                 trl_args: tuple[str, ...], plan_path: str | None, device: str | None, cache_dir: str | None,
                 as_json: bool, workers: int, worker_memory: float | None, shard_option: str | None,
                 shard_count: int | None, status: bool) -> None:
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
      shapeplan warm --plan plan.json --shard 3/8 --cache-dir /fsx/shapeplan
      shapeplan warm --plan plan.json --status --cache-dir /fsx/shapeplan
    """
    import os

    from ..warm.cachedir import check_cache_dir
    from ..warm.parallel import worker_count
    from ..warm.runner import warm
    from ..warm.shards import resolve_shard

    if status:
        _status(plan_path, method, model, eval_dataset, split, trl_args, device, cache_dir, as_json)
        return
    shard = resolve_shard(shard_option, shard_count, os.environ)
    backend, cache = prepare(device, cache_dir)
    with refused_leaves_no_cache_dir(cache):
        plan, warmer = load_run(plan_path, method, model, eval_dataset, split, trl_args, backend.device)
        count = worker_count(workers, backend.device, worker_memory)
        if count > 1 and int(plan.config.get("num_processes", 1)) > 1:
            raise UsageError("a data-parallel plan is warmed under `accelerate launch` with its number of "
                             "processes, whose ranks share the shapes; drop --workers")
    check_cache_dir(cache)
    if count > 1:
        report = _warm_in_workers(plan, count, backend.device, cache, shard)
    else:
        report = warm(plan, warmer, backend, cache, progress=True, shard=shard)
    emit(report, as_json=as_json, verify=False)


def _status(plan_path: str | None, method: str, model: str | None, eval_dataset: str | None, split: str | None,
            trl_args: tuple[str, ...], device: str | None, cache_dir: str | None, as_json: bool) -> None:
    """`warm --status`: the plan's shapes against the cache dir's merged manifests; exit 1 unless complete."""
    from ..warm.manifest import plan_status, read_merged

    if plan_path is None:
        raise UsageError("--status needs --plan PLAN: the plan whose shapes to look up")
    backend, cache = choose_backend(device, cache_dir)
    plan, warmer = load_run(plan_path, method, model, eval_dataset, split, trl_args, backend.device)
    warmer.bind(plan)
    report = plan_status(list(warmer.tasks(plan)), read_merged(cache))  # a missing cache dir holds nothing
    if as_json:
        click.echo(json.dumps({"cache_dir": str(cache), **report.to_dict()}, indent=2))
    else:
        for key, label in report.tasks.items():
            where = ", ".join(f"shard {d['shard'] or '-'} env {d['environment']}" for d in report.done[key])
            click.echo(f"{'done' if where else 'missing':<8} {label:<22} {where}")
        for env_key, environment in report.environments.items():
            click.echo(f"environment {env_key}: {json.dumps(environment.get('versions'), sort_keys=True)} "
                       f"{json.dumps(environment.get('compiler'), sort_keys=True)}")
        click.echo(f"{len(report.tasks) - len(report.missing)}/{len(report.tasks)} shape(s) done, "
                   f"{'complete' if report.complete else 'incomplete'}  (cache: {cache})")
    if not report.complete:
        raise click.exceptions.Exit(1)


def _warm_in_workers(plan: Any, count: int, device: str, cache: Path, shard: Any) -> Any:
    """The plan, written for the workers to read, warmed by `count` worker processes."""
    import os
    import tempfile

    from ..plan.io import remove_stale, write_plan
    from ..warm.parallel import run_workers

    remove_stale(Path(tempfile.gettempdir()), "shapeplan-workers-")  # folders of killed warm-ups
    with tempfile.TemporaryDirectory(prefix=f"shapeplan-workers-{os.getpid()}-") as folder:
        plan_file = Path(folder) / "plan.json"
        write_plan(plan, plan_file)
        return run_workers(plan_file, count=count, device=device, cache_dir=cache, shard=shard)
