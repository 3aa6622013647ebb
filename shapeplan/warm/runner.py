"""Warming a plan: the tasks from the plan, skipping what the manifest holds, this process's share of them, and the
run through the method's `Warmer` on a compiler `Backend`, accounted per task by a `Tracker`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import PlanFileError, UsageError
from ..plan.io import dumps
from ..plan.model import Plan, Shape
from .backends.base import Backend
from .manifest import Manifest, check_same_peft, environment_key, manifest_name, read_merged
from .model import Task, WarmReport, WarmResult, WarmTask
from .parallel import current_part
from .shards import Shard, shard_tasks, split
from .tracker import Progress, TaskT, Tracker

# Phases the trainer-loop warmers run as tasks (DPO and KTO add `ref_precompute`); a warmer's `inner_phases` run
# inside them; generate tasks belong to the generation warmers.
WARMED_PHASES: tuple[str, ...] = ("train", "eval")



class Warmer(Protocol[TaskT]):
    """One TRL method's warm-up: runs tasks through that trainer's real step, reporting to a Tracker."""

    torch_compile: bool
    warnings: list[str]  # what the warm-up could not reproduce exactly, for the report
    # every rank's tasks, which the runner sets when the run's ranks warm in lockstep under `accelerate launch`
    # (methods whose TrainerSpec has `lockstep`); None: this process warms the tasks `run` is given
    shares: list[list[TaskT]] | None

    def bind(self, plan: Plan) -> None:
        """Take what the warm-up needs from `plan`. Raise PlanFileError if `plan` was made for another method,
        model or tokenizer."""
        ...

    def tasks(self, plan: Plan) -> Sequence[TaskT]:
        """The plan's tasks, in plan order (most warmers: `tasks_from_plan`)."""
        ...

    def environment(self) -> dict[str, Any]:
        """What besides the backend shapes the compiled code: versions, world size, dtype, model, config hash."""
        ...

    def run(self, tasks: Sequence[TaskT], context: Sequence[TaskT], tracker: Tracker) -> None:
        """Run `tasks`; `context` is every task of the plan (a warmer may need an already warmed one to carry
        the eval loop). Calls tracker.start() before the first, then charge/finish/fail per task."""
        ...


def tasks_from_plan(plan: Plan, *, eval_passes: int, inner_phases: dict[str, str] | None = None,
                    phases: tuple[str, ...] = WARMED_PHASES) -> tuple[WarmTask, ...]:
    """One task per planned shape of `phases`, in plan order; a shape of an inner phase is warmed by a task of its
    host phase with as many rows, which the plan must hold."""
    inner_phases = inner_phases or {}
    planned = {(s.phase, s.batch) for s in plan.shapes}
    tasks = []
    for shape in plan.shapes:
        if shape.phase in inner_phases:
            if (inner_phases[shape.phase], shape.batch) not in planned:
                raise PlanFileError(f"the plan has a {shape.phase} shape ({shape.batch}, {shape.seq}) without a "
                                    f"{inner_phases[shape.phase]} shape of {shape.batch} rows to run it; re-create "
                                    "the plan with `shapeplan analyze`")
            continue
        if shape.phase not in phases:
            raise PlanFileError(f"the plan has {shape.phase} shapes, which a {plan.method} run does not meet; "
                                "re-create the plan with `shapeplan analyze`")
        per_pass = 1
        if shape.phase == "eval":
            per_pass = shape.count // eval_passes if eval_passes and shape.count % eval_passes == 0 else shape.count
        tasks.append(WarmTask(phase=shape.phase, batch=shape.batch, seq=shape.seq, varlen_pairs=shape.varlen_pairs,
                              padded=shape.unpadded < shape.count, unpadded=shape.unpadded > 0,
                              completion_tokens=shape.completion_tokens, chosen_rows=shape.chosen_rows,
                              per_pass=per_pass, images=shape.images, pixel_values=shape.pixel_values,
                              text_runs=shape.text_runs))
    return tuple(tasks)


def plan_id(plan: Plan) -> str:
    """A short fingerprint of the plan's content, which the manifest records with each shape it warmed."""
    return hashlib.sha256(dumps(plan).encode()).hexdigest()[:12]


def graph_bound(tasks: Sequence[Task] | Sequence[Shape]) -> int:
    """An upper bound on the graphs one compiled frame meets: every synthetic batch layout of every task (a vision
    batch's every row: Qwen-VL's position ids loop over rows, each with its own ints, around graph breaks); of a
    plan's shapes, for a guarded run."""
    return sum(max(2, len(getattr(t, "varlen_pairs", ())), len(getattr(t, "text_runs", ())) * t.batch)
               for t in tasks)


def warm(plan: Plan, warmer: Warmer[Any], backend: Backend, cache_dir: Path, *, verify: bool = False,
         progress: Progress | None = None, shard: Shard | None = None) -> WarmReport:
    """Run every planned shape (`shard`'s share of them) through `warmer` on `backend`, caching into `cache_dir`
    (already `prepare`d), reporting each finished shape to `progress` (None: silently). A shape any manifest file
    of `cache_dir` holds is skipped.

    verify=True runs every shape regardless of the manifest and writes none: it reports what compiled (the
    caller points the backend at a `scratch_view` of `cache_dir`, so compiles do not land there either).
    """
    warmer.bind(plan)
    tasks = warmer.tasks(plan)
    mine = shard_tasks(tasks, shard)
    graphs = graph_bound(tasks)
    backend.configure(torch_compile=warmer.torch_compile, graphs=graphs)
    environment = {**warmer.environment(), "compiler": backend.settings()}
    manifest = None if verify else Manifest(cache_dir / manifest_name(shard))
    key = environment_key(environment)
    merged = read_merged(cache_dir)
    warmed = None
    if verify:
        check_same_peft(merged, environment)
        warmed = {task: entry["keys"] for task, entry in merged.environments.get(key, {}).get("shapes", {}).items()
                  if isinstance(entry.get("keys"), dict)}
    skipped = [t for t in mine if not verify and merged.done(key, t)]
    todo = [t for t in mine if t not in skipped]
    part = current_part()
    lockstep = False
    world = int(plan.config.get("num_processes", 1))
    if world > 1 and (part is None or not part.ranks):
        warmer.warnings.append(f"the run has {world} processes and the warm-up one: every rank's shapes are warmed, "
                               f"the collectives between ranks are not (warm under `accelerate launch "
                               f"--num_processes {world}` for them)")
    if part is not None:  # one of several workers or ranks: warm this one's share
        shares = split(todo, part.count)
        if part.ranks:
            if part.count != world:
                raise UsageError(f"the plan is for {world} process(es) and `accelerate launch` started {part.count}; "
                                 f"launch with --num_processes {world}, the run's world size")
            warmer.shares = shares
            lockstep = any(shares)  # a rank with nothing left still steps with the others
        todo = shares[part.index]
    tracker = Tracker(backend, warmed=warmed, manifest=manifest, environment=environment, total=len(todo),
                         progress=progress, plan=plan_id(plan),
                         eager=not backend.compiles(torch_compile=warmer.torch_compile))
    for task in skipped:
        tracker.results[task] = WarmResult(task=task, status="skipped", seconds=0.0)
    try:
        if todo or lockstep:
            warmer.run(todo, tasks, tracker)
        for task in tracker.pending(todo):  # a warmer that returns early leaves tasks unaccounted: they failed
            tracker.fail(task, "not run")
    finally:
        tracker.close()
    if tracker.manifest_error is not None:  # shapes compiled but not recorded: no pipeline may read success
        raise tracker.manifest_error
    return WarmReport(
        results=tuple(tracker.results[t] for t in mine if t in tracker.results),
        cache_dir=str(cache_dir),
        device=backend.device,
        environment=environment,
        script_lines=backend.script_lines(cache_dir, torch_compile=warmer.torch_compile, graphs=graphs),
        # what the backend found of the cache dir (a dir per rank, NFS) and, in verify, of each shape's keys
        warnings=tuple(dict.fromkeys([*warmer.warnings, *getattr(backend, "warnings", ()), *tracker.findings])),
        shard=shard,
        covered=covered_shapes(plan, tasks),
    )


def covered_shapes(plan: Plan, tasks: Sequence[Task]) -> tuple[tuple[str, int, int], ...]:
    """The plan's distinct (phase, batch, seq) that no task has: shapes its warmer runs inside its tasks' rounds."""
    own = {(t.phase, t.batch, t.seq) for t in tasks}
    shapes = dict.fromkeys((s.phase, s.batch, s.seq) for s in plan.shapes)
    return tuple(shape for shape in shapes if shape not in own)
