"""Warming a plan: tasks from the plan, the manifest (skip what is warmed, resume after a kill), per-shape
accounting. Method-specific work is a `Warmer`; compiler-specific work is a `Backend`.

The manifest (`shapeplan-manifest.json` in the cache dir) is the record of completed shapes: a shape enters it,
atomically, only after its step finished, so a run killed mid-shape leaves the manifest as it was and the next
run redoes that shape (the compile caches write their own entries atomically too).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..errors import CacheError, PlanFileError, UsageError
from ..host import cache_root
from ..plan.io import write_atomic
from ..plan.model import Plan
from ..trainers import TRAINERS
from .backends.base import Backend, counter_delta
from .model import ManifestEntry, Task, WarmReport, WarmResult, WarmTask
from .parallel import current_part, split

MANIFEST = "shapeplan-manifest.json"
MANIFEST_SCHEMA = 1
# Phases a warmer runs as tasks; a warmer's `inner_phases` run inside them; the others (generate, ...) belong to
# warmers not built yet.
WARMED_PHASES = ("train", "eval")


TaskT = TypeVar("TaskT", bound=Task)


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


def make_warmer(method: str, args: Any) -> Warmer[Any]:
    """The warmer of `method` (its `TrainerSpec`) for the run `args`."""
    if method not in TRAINERS:
        raise PlanFileError(f"`shapeplan warm` cannot run {method} plans yet; supported: {', '.join(TRAINERS)}")
    return TRAINERS[method].warmer(args)


def tasks_from_plan(plan: Plan, *, eval_passes: int, inner_phases: dict[str, str] | None = None) -> tuple[
        WarmTask, ...]:
    """One task per planned train/eval shape, in plan order; a shape of an inner phase is warmed by a task of its
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
        if shape.phase not in WARMED_PHASES:
            raise PlanFileError(f"the plan has {shape.phase} shapes, which `shapeplan warm` cannot run yet; "
                                "it warms train and eval shapes")
        per_pass = 1
        if shape.phase != "train":
            per_pass = shape.count // eval_passes if eval_passes and shape.count % eval_passes == 0 else shape.count
        tasks.append(WarmTask(phase=shape.phase, batch=shape.batch, seq=shape.seq, varlen_pairs=shape.varlen_pairs,
                              padded=shape.unpadded < shape.count, unpadded=shape.unpadded > 0,
                              completion_tokens=shape.completion_tokens, chosen_rows=shape.chosen_rows,
                              per_pass=per_pass))
    return tuple(tasks)


def graph_bound(tasks: Sequence[Task]) -> int:
    """An upper bound on the graphs one compiled frame meets: every synthetic batch layout of every task."""
    return sum(max(2, len(getattr(t, "varlen_pairs", ()))) for t in tasks)


def environment_key(environment: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(environment, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_cache_dir(device: str) -> Path:
    """The compile cache of `device`'s compiler stack, under the cache root."""
    return cache_root() / ("neuron" if device == "neuron" else f"inductor-{device}")


def check_cache_dir(path: Path) -> Path:
    """Create `path` if needed and prove it writable."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".shapeplan-probe-"):
            pass
    except OSError as exc:
        raise CacheError(f"cache dir {path} is not writable ({exc.strerror}); pass a writable folder with "
                         "--cache-dir") from exc
    return path.resolve()


class Manifest:
    """The cache dir's record of warmed shapes, per environment."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = self._read()

    def _read(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {"schema": MANIFEST_SCHEMA, "environments": {}}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CacheError(f"manifest {self.path} is unreadable ({exc}); delete it to re-warm this cache dir") \
                from exc
        if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
            raise CacheError(f"manifest {self.path} has an unknown schema; delete it to re-warm this cache dir")
        return data

    def done(self, environment: str, task: WarmTask) -> bool:
        entry = self.data["environments"].get(environment, {}).get("shapes", {}).get(task.key)
        return entry is not None and entry.get("status") in ("compiled", "cached")

    def record(self, entry: ManifestEntry, environment: dict[str, Any]) -> None:
        """Add `entry` under a lock, to the manifest as it is on disk: other processes (workers, ranks) record
        into the same manifest."""
        from .parallel import locked

        try:
            with locked(self.path):
                self.data = self._read()
                section = self.data["environments"].setdefault(entry.environment,
                                                               {"environment": environment, "shapes": {}})
                section["shapes"][entry.task] = entry.to_dict()
                write_atomic(self.path, json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            raise CacheError(f"cannot write manifest {self.path}: {exc.strerror}; pass a writable --cache-dir") \
                from exc


class Tracker:
    """Times each task and reads the compile counters around it; records finished tasks in the manifest."""

    def __init__(self, backend: Backend, *, manifest: Manifest | None, environment: dict[str, Any],
                 total: int, progress: bool) -> None:
        self.backend = backend
        self.manifest = manifest
        self.environment = environment
        self.env_key = environment_key(environment)
        self.results: dict[Task, WarmResult] = {}
        self._spent: dict[Task, tuple[float, dict[str, int]]] = {}
        self._mark: tuple[float, dict[str, int]] | None = None
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="warming", unit="shape", file=sys.stderr, dynamic_ncols=True)

    def start(self) -> None:
        """Begin counting: what ran before (loading, set-up) is charged to no task."""
        self._mark = (time.perf_counter(), self.backend.counters())

    def charge(self, task: Task) -> None:
        """Charge the time and counter changes since the last mark to `task`."""
        assert self._mark is not None, "Tracker.start() must come first"
        now, counters = time.perf_counter(), self.backend.counters()
        seconds, delta = self._spent.get(task, (0.0, {}))
        step = counter_delta(self._mark[1], counters)
        merged = {k: delta.get(k, 0) + step.get(k, 0) for k in set(delta) | set(step)}
        self._spent[task] = (seconds + now - self._mark[0], merged)
        self._mark = (now, counters)

    def finish(self, task: Task) -> None:
        self.charge(task)
        seconds, delta = self._spent.pop(task)
        status = "compiled" if self.backend.compiled(delta) else "cached"
        self._done(WarmResult(task=task, status=status, seconds=seconds, counters=delta))

    def fail(self, task: Task, error: str) -> None:
        if self._mark is not None:
            self.charge(task)
        seconds, delta = self._spent.pop(task, (0.0, {}))
        self._done(WarmResult(task=task, status="failed", seconds=seconds, counters=delta, error=error))

    def pending(self, tasks: Sequence[TaskT]) -> list[TaskT]:
        return [t for t in tasks if t not in self.results]

    def _done(self, result: WarmResult) -> None:
        self.results[result.task] = result
        if self.manifest is not None:
            self.manifest.record(ManifestEntry(environment=self.env_key, task=result.task.key, status=result.status,
                                               seconds=result.seconds, counters=result.counters), self.environment)
        if self._bar is not None:
            self._bar.write(result_row(result), file=sys.stderr)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def result_row(result: WarmResult) -> str:
    counters = " ".join(f"{k}={v:+d}" for k, v in sorted(result.counters.items()))
    text = f"{result.status:<9} {result.task.label:<22} {result.seconds:8.1f}s  {counters}"
    return text + (f"  {result.error}" if result.error else "")


def warm(plan: Plan, warmer: Warmer[Any], backend: Backend, cache_dir: Path, *, verify: bool = False,
         progress: bool = True) -> WarmReport:
    """Run every planned shape through `warmer` on `backend`, caching into `cache_dir` (already `prepare`d).

    verify=True runs every shape regardless of the manifest and writes nothing: it reports what compiled.
    """
    warmer.bind(plan)
    tasks = warmer.tasks(plan)
    graphs = graph_bound(tasks)
    backend.configure(torch_compile=warmer.torch_compile, graphs=graphs)
    environment = {**warmer.environment(), "compiler": backend.settings()}
    manifest = None if verify else Manifest(cache_dir / MANIFEST)
    key = environment_key(environment)
    skipped = [t for t in tasks if manifest is not None and manifest.done(key, t)]
    todo = [t for t in tasks if t not in skipped]
    part = current_part()
    lockstep = False
    if part is not None:  # one of several workers or ranks: warm this one's share
        shares = split(todo, part.count)
        if part.ranks:
            if not TRAINERS[plan.method].lockstep:
                lockstep_methods = ", ".join(name for name, spec in TRAINERS.items() if spec.lockstep)
                raise UsageError(f"warming under `accelerate launch` is supported for {lockstep_methods} runs; "
                                 "run `shapeplan warm` in one process (use --workers to use several cores)")
            warmer.shares = shares
            lockstep = any(shares)  # a rank with nothing left still steps with the others
        todo = shares[part.index]
    tracker = Tracker(backend, manifest=manifest, environment=environment, total=len(todo), progress=progress)
    for task in skipped:
        tracker.results[task] = WarmResult(task=task, status="skipped", seconds=0.0)
    try:
        if todo or lockstep:
            warmer.run(todo, tasks, tracker)
        for task in tracker.pending(todo):  # a warmer that returns early leaves tasks unaccounted: they failed
            tracker.fail(task, "not run")
    finally:
        tracker.close()
    return WarmReport(
        results=tuple(tracker.results[t] for t in tasks if t in tracker.results),
        cache_dir=str(cache_dir),
        device=backend.device,
        environment=environment,
        script_lines=backend.script_lines(cache_dir, torch_compile=warmer.torch_compile, graphs=graphs),
        warnings=tuple(dict.fromkeys(warmer.warnings)),
    )
