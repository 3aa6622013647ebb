"""`shapeplan warm`: compile every planned shape before training, through the trainer's real step."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from ..errors import ShapeplanError, UsageError
from ..plan.targets import check_output, named_files, write_output
from .options import FiniteFloat, device_option, quiet_option, run_options
from .output import ProgressBar, emit_caveats, emit_warm, note, quiet, quiet_libraries


def prepare(backend: Any, cache: Path) -> None:
    """Set the backend up before torch is imported (backends read env vars at import). The cache dir is created
    (`check_cache_dir`) only once the run is known to be valid: a refused command leaves none behind."""
    from ..cache.contents import refuse_incomplete_import
    from ..warm.cachedir import check_cache_dir_can_exist

    check_cache_dir_can_exist(cache)
    refuse_incomplete_import(cache)
    backend.prepare(cache)
    quiet_libraries()


@contextlib.contextmanager
def refused_leaves_no_cache_dir(cache: Path) -> Iterator[None]:
    """Importing torch creates the compile cache dir named in its environment, before the run is known to be
    valid: a refused command removes it again if it made it and nothing was written into it."""
    missing = [p for p in (cache, *cache.parents) if not p.exists()]  # the folders a refusal must not leave
    try:
        yield
    except ShapeplanError:
        if missing:
            top = missing[-1]
            for folder in sorted((p for p in [top, *top.rglob("*")] if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):  # not empty: keep it
                    folder.rmdir()
        raise


@click.command("warm", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True})
@run_options
@quiet_option
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None, metavar="PLAN",
              help="Warm this plan (from `shapeplan analyze -o`) instead of planning the run first.")
@device_option
@click.option("--workers", type=int, default=1, show_default=True, metavar="N",
              help="Warm in N processes at once, each on its share of the shapes (on neuron: its own NeuronCore, "
              "within NEURON_RT_VISIBLE_CORES when set), capped by host memory and the visible NeuronCores.")
@click.option("--worker-memory-gib", "worker_memory", type=FiniteFloat(min=0.1), default=None, metavar="GIB",
              help="Host memory one worker needs (default: 24 on neuron, 8 on cuda, 2 on cpu).")
@click.option("--shard", "shard_option", default=None, metavar="I/N",
              help="Warm shard I of N (from 0) of the plan's shapes, into its own manifest file; default: from "
              "SLURM_ARRAY_TASK_ID, JOB_COMPLETION_INDEX or AWS_BATCH_JOB_ARRAY_INDEX. See docs/fleet.md.")
@click.option("--shard-count", type=int, default=None, metavar="N",
              help="The shard count of a Kubernetes Indexed Job (JOB_COMPLETION_INDEX comes without one).")
@click.option("--env-file", "env_file", type=click.Path(dir_okay=False), default=None, metavar="PATH",
              help="Also write the environment training needs to hit the cache (the `export` lines) to PATH, "
              "atomically, for a Packer, systemd or Kubernetes step to source.")
@click.option("--status", "status", is_flag=False, flag_value="", default=None, metavar="[URL]",
              help="Warm nothing: show, from every manifest in the cache dir (or in the store at URL), which shapes "
              "are done (by which shard or push, in which environment) and which are missing. Exit 0 only when the "
              "plan is complete.")
@click.option("--pull", "pull_url", default=None, metavar="URL",
              help="First pull from the store at URL what it holds of the plan's shapes for this environment "
              "(`cache pull --plan`), then warm the rest.")
@click.option("--push", "push_url", default=None, metavar="URL",
              help="Then push the cache dir to the store at URL (`cache push`), failed shapes or not.")
def warm_command(method: str | None, model: str | None, eval_dataset: str | None, split: str | None,
                 trl_args: tuple[str, ...], plan_path: str | None, device: str | None, cache_dir: str | None,
                 as_json: bool, workers: int, worker_memory: float | None, shard_option: str | None,
                 shard_count: int | None, env_file: str | None, status: str | None, pull_url: str | None,
                 push_url: str | None) -> None:
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
      shapeplan warm --plan plan.json --pull s3://bucket/shapeplan --push s3://bucket/shapeplan
    """
    import os

    from ..services.run import choose_backend, load_run
    from ..warm.cachedir import check_cache_dir
    from ..warm.parallel import current_part, worker_count
    from ..warm.runner import warm
    from ..warm.shards import resolve_shard

    if plan_path is not None and click.get_current_context().get_parameter_source("method") is ParameterSource.DEFAULT:
        method = None  # the plan names it; a --method given is checked against the plan
    if status is not None:
        _status(plan_path, method, model, eval_dataset, split, trl_args, device, cache_dir, as_json, status or None)
        return
    shard = resolve_shard(shard_option, shard_count, os.environ)
    backend, cache = choose_backend(device, cache_dir)
    inputs = named_files([plan_path, *trl_args, eval_dataset, model])
    if env_file is not None:  # before the warm-up's hours
        check_output(env_file, "--env-file", inputs=inputs, cache_dirs=[cache])
    for url in (pull_url, push_url):  # so are the stores
        if url is not None:
            from ..cache.store import open_store, refuse_overlap

            refuse_overlap(open_store(url), cache)
    with refused_leaves_no_cache_dir(cache):
        prepare(backend, cache)
        plan, warmer = load_run(plan_path, method, model, eval_dataset, split, trl_args, backend.device)
        count = worker_count(workers, backend.device, worker_memory)
        if count > 1 and int(plan.config.get("num_processes", 1)) > 1:
            raise UsageError("a data-parallel plan is warmed under `accelerate launch` with its number of "
                             "processes, whose ranks share the shapes; drop --workers")
        check_cache_dir(cache)
        emit_caveats(plan, with_plan_warnings=True)  # before the warm-up's hours, as `analyze` shows them
        part = current_part()
        if backend.device == "cpu" and warmer.torch_compile and (part is None or part.index == 0):  # said once
            note("note: torch_compile on CPU: Inductor compiles each shape's forward and backward to C++, a minute "
                 "or more a shape here (seconds eager); each shape's row comes as it finishes")
        if pull_url is not None:
            _pull_plan(pull_url, plan, warmer, backend.device, cache)
        progress = ProgressBar(quiet=quiet())
        if count > 1:
            report = _warm_in_workers(plan, count, backend.device, cache, shard)
        else:  # refused before its first shape (the run's model or tokenizer): the dir made for it is removed
            report = warm(plan, warmer, backend, cache, progress=progress, shard=shard)
    if push_url is not None:
        from ..cache.store import push

        pushed = push(cache, push_url)
        note(f"pushed {pushed.shapes} warmed shape(s) to {push_url}: {pushed.uploaded} new object(s)")
    if env_file is not None:
        _write_env_file(report, env_file, inputs, cache)
    from ..services.trl_command import training_command
    from ..warm.backends.inductor import python_only

    command = training_command(plan, plan_path, eval_source=eval_dataset, device=backend.device,
                               python_lines=python_only(report.script_lines))
    emit_warm(report, as_json=as_json, verify=False, command=command, env_file=env_file,
              rows_shown=progress.rows > 0)


def _pull_plan(url: str, plan: Any, warmer: Any, device: str, cache: Path) -> None:
    """`warm --pull`: what the store holds of the plan's shapes, compiled for this machine (nothing if none)."""
    from ..cache.store_pull import pull

    warmer.bind(plan)
    pulled = pull(url, cache, device=device, tasks={t.key for t in warmer.tasks(plan)}, allow_empty=True)
    note(f"pulled {url}: {pulled.used} push(es) for this environment, {pulled.downloaded} object(s) downloaded, "
         f"{pulled.shapes} shape(s) added")


def _write_env_file(report: Any, path: str, inputs: list[str], cache: Path) -> None:
    from ..services.report import render_env_file

    try:
        write_output(path, render_env_file(report), "--env-file", inputs=inputs, cache_dirs=[cache])
    except OSError as exc:
        raise ShapeplanError(f"cannot write --env-file {path}: {exc.strerror}; choose a writable path") from exc
    note(f"environment written to {path} (source it before training)")


def _status(plan_path: str | None, method: str | None, model: str | None, eval_dataset: str | None, split: str | None,
            trl_args: tuple[str, ...], device: str | None, cache_dir: str | None, as_json: bool,
            url: str | None) -> None:
    """`warm --status [URL]`: the plan's shapes against the cache dir's (or the store's) merged manifests, each
    compiled, cached, eager (it ran, and left nothing in the cache) or missing; exit 1 unless one environment holds
    every shape compiled or cached."""
    from ..services.run import choose_backend, plan_tasks
    from ..warm.manifest import differences_from_here, plan_status, read_merged

    if plan_path is None:
        raise UsageError("--status needs --plan PLAN: the plan whose shapes to look up")
    backend, cache = choose_backend(device, cache_dir)
    tasks = plan_tasks(plan_path, backend.device, method, model, eval_dataset, split, trl_args)
    if url is None:
        report = plan_status(tasks, read_merged(cache))  # a missing cache dir holds nothing
    else:
        from ..cache.store import merged, read_manifests

        report = plan_status(tasks, merged(read_manifests(url)))
    where = {"cache_dir": str(cache)} if url is None else {"url": url}
    states = {key: _state(entries) for key, entries in report.done.items()}
    counts = {state: sum(1 for s in states.values() if s == state)
              for state in ("compiled", "cached", "eager", "missing")}
    differences = differences_from_here(report, backend.device) if report.complete else []
    if differences:  # complete for the hosts that warmed it, not for a run here
        click.echo(f"warning: the plan is complete only in environments other than this machine's: "
                   f"{'; '.join(differences)}; a run here would compile its shapes again", err=True)
    if counts["eager"] and not report.complete:
        click.echo(f"warning: {counts['eager']} shape(s) only ran eager (cpu/cuda without torch_compile), which "
                   "leaves nothing in the cache for training to hit; warm a cache with --torch_compile true "
                   "(Inductor) or on Trainium (--device neuron)", err=True)
    if as_json:
        click.echo(json.dumps({**where, **report.to_dict(), "counts": counts}, indent=2))
    else:
        for key, label in report.tasks.items():
            found = ", ".join(f"{'shard' if url is None else 'push'} {d['shard'] or '-'} env {d['environment']} "
                              f"({d['status']})" for d in report.done[key])
            shown = "done" if states[key] in ("compiled", "cached") else states[key]
            click.echo(f"{shown:<8} {label:<22} {found}")
        for env_key, environment in report.environments.items():
            click.echo(f"environment {env_key}: {json.dumps(environment.get('versions'), sort_keys=True)} "
                       f"{json.dumps(environment.get('compiler'), sort_keys=True)}")
        cached = counts["compiled"] + counts["cached"]
        missing = f", {counts['missing']} missing" if counts["missing"] else ""
        click.echo(f"{cached}/{len(report.tasks)} shape(s) done, {'complete' if report.complete else 'incomplete'}: "
                   f"{counts['compiled']} compiled, {counts['cached']} cached, {counts['eager']} eager{missing}  "
                   f"({'cache' if url is None else 'store'}: {cache if url is None else url})")
    if not report.complete:
        raise click.exceptions.Exit(1)


def _state(entries: list[dict[str, Any]]) -> str:
    """A shape's state across the environments that hold it: compiled (in one at least), else cached, else eager,
    else missing."""
    statuses = {entry["status"] for entry in entries}
    return next((state for state in ("compiled", "cached", "eager") if state in statuses), "missing")


def _warm_in_workers(plan: Any, count: int, device: str, cache: Path, shard: Any) -> Any:
    """The plan, written for the workers to read, warmed by `count` worker processes."""
    import os
    import tempfile

    from ..plan.io import remove_stale, write_plan
    from ..warm.parallel import run_workers

    remove_stale(Path(tempfile.gettempdir()), "shapeplan-workers-")  # folders of killed warm-ups
    before = os.environ.get("SHAPEPLAN_QUIET")
    if quiet():  # the workers' own rows go to this stderr: they are quiet too (they inherit the environment)
        os.environ["SHAPEPLAN_QUIET"] = "1"
    try:
        with tempfile.TemporaryDirectory(prefix=f"shapeplan-workers-{os.getpid()}-") as folder:
            plan_file = Path(folder) / "plan.json"
            write_plan(plan, plan_file)
            return run_workers(plan_file, count=count, device=device, cache_dir=cache, shard=shard)
    finally:
        if before is None:
            os.environ.pop("SHAPEPLAN_QUIET", None)
        else:
            os.environ["SHAPEPLAN_QUIET"] = before
