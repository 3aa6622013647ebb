"""Warming a plan: tasks from the plan, the manifest (skip what is warmed, resume after a kill), per-shape
accounting. Method-specific work is a `Warmer`; compiler-specific work is a `Backend`.

The manifest (`shapeplan-manifest.json` in the cache dir) is the record of completed shapes: a shape enters it,
atomically, only after its step finished, so a run killed mid-shape leaves the manifest as it was and the next
run redoes that shape (the compile caches write their own entries atomically too).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..errors import CacheError, PlanFileError, UsageError
from ..host import cache_root
from ..plan.io import remove_stale, write_atomic
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
        remove_stale(path, ".shapeplan-probe-")  # probes of killed runs
        with tempfile.NamedTemporaryFile(dir=path, prefix=f".shapeplan-probe-{os.getpid()}-"):
            pass
    except OSError as exc:
        raise CacheError(f"cache dir {path} is not writable ({exc.strerror}); pass a writable folder with "
                         "--cache-dir") from exc
    return path.resolve()


def check_cache_dir_can_exist(path: Path) -> None:
    """Refuse, without creating anything, a cache dir that cannot become a folder: `check_cache_dir` runs only once
    the run is valid (a refused command leaves no dir), but importing torch already creates the dir it is given."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise CacheError(f"cache dir {path} is not writable ({os.strerror(errno.ENOTDIR)}); pass a writable folder "
                         "with --cache-dir")


def existing_cache_dir(path: Path) -> Path:
    """`path`, which must be a folder already: `verify` checks a warmed cache and never creates or writes one."""
    if not path.exists():
        raise CacheError(f"cache dir {path} does not exist; warm it with `shapeplan warm --cache-dir {path}` first, "
                         "or pass the warmed folder with --cache-dir")
    if not path.is_dir():
        raise CacheError(f"cache dir {path} is not a folder; pass the folder `shapeplan warm --cache-dir` wrote")
    return path.resolve()


@contextmanager
def scratch_view(cache_dir: Path) -> Iterator[Path]:
    """A private, writable folder holding `cache/`, a view of `cache_dir`, deleted on exit.

    Compiles land in the view and are thrown away, so `cache_dir` is only read (it may be read-only). Files are
    hard links where the file system allows (compilers replace a cache file by renaming a new one into place,
    which leaves the linked original alone), else copies; lock files are per-process state, not cache content,
    and are left out (opening one truncates it).
    """
    root = _scratch_root(cache_dir)
    try:
        try:
            view = root / "cache"
            shutil.copytree(cache_dir, view, symlinks=True, copy_function=_link_or_copy,
                            ignore=shutil.ignore_patterns("*.lock"))
            for folder, _, _ in os.walk(view):  # copytree copies the folders' modes, a read-only cache's too
                os.chmod(folder, os.stat(folder).st_mode | stat.S_IRWXU)
        except OSError as exc:
            reason = exc.strerror or "some files cannot be read"  # shutil.Error lists its failures instead
            raise CacheError(f"cannot make a scratch view of cache dir {cache_dir} in {root} ({reason}); verify "
                             "must read every file of the cache dir and have space for the view (set TMPDIR to "
                             "use another folder)") from exc
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _scratch_root(cache_dir: Path) -> Path:
    """A new folder next to `cache_dir` (the same file system, so hard links work), else in the temp dir."""
    try:
        return Path(tempfile.mkdtemp(prefix=".shapeplan-verify-", dir=cache_dir.parent))
    except OSError:  # a read-only parent: the temp dir, where files are copied if they cannot be linked
        pass
    try:
        return Path(tempfile.mkdtemp(prefix="shapeplan-verify-"))
    except OSError as exc:
        raise CacheError(f"cannot create a scratch folder for verify in {tempfile.gettempdir()} ({exc.strerror}); "
                         "set TMPDIR to a writable folder") from exc


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, a read-only mount, a file system without hard links
        shutil.copy2(source, target)


def _manifest_well_formed(data: dict[str, Any]) -> bool:
    """{"environments": {key: {"environment": {...}, "shapes": {task: {"status": str, ...}}}}}"""
    environments = data.get("environments")
    if not isinstance(environments, dict):
        return False
    for section in environments.values():
        if not (isinstance(section, dict) and isinstance(section.get("environment"), dict)
                and isinstance(section.get("shapes"), dict)):
            return False
        if not all(isinstance(e, dict) and isinstance(e.get("status"), str) for e in section["shapes"].values()):
            return False
    return True


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
        except OSError as exc:
            raise CacheError(f"manifest {self.path} is unreadable ({exc.strerror}); delete it to re-warm this cache "
                             "dir") from exc
        except ValueError as exc:  # bad JSON, or bytes that are not UTF-8
            raise CacheError(f"manifest {self.path} is not UTF-8 JSON ({exc}); delete it to re-warm this cache dir") \
                from exc
        if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
            raise CacheError(f"manifest {self.path} has an unknown schema; delete it to re-warm this cache dir")
        if not _manifest_well_formed(data):
            raise CacheError(f"manifest {self.path} does not have a manifest's structure; delete it to re-warm this "
                             "cache dir")
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

    def steady(self, task: Task, *, micro_batches: int) -> None:
        """Record the seconds since the last mark, per micro-batch, as `task`'s steady-state seconds: a finished
        task run once more, so nothing compiles. Charged to no task's warm-up time."""
        assert self._mark is not None, "Tracker.start() must come first"
        now = time.perf_counter()
        result = replace(self.results[task], steady_seconds=(now - self._mark[0]) / micro_batches)
        self.results[task] = result
        self._mark = (now, self.backend.counters())
        self._record(result)

    def pending(self, tasks: Sequence[TaskT]) -> list[TaskT]:
        return [t for t in tasks if t not in self.results]

    def _done(self, result: WarmResult) -> None:
        self.results[result.task] = result
        self._record(result)
        if self._bar is not None:
            self._bar.write(result_row(result), file=sys.stderr)
            self._bar.update(1)

    def _record(self, result: WarmResult) -> None:
        if self.manifest is not None:
            self.manifest.record(ManifestEntry(environment=self.env_key, task=result.task.key, status=result.status,
                                               seconds=result.seconds, counters=result.counters,
                                               steady_seconds=result.steady_seconds), self.environment)

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

    verify=True runs every shape regardless of the manifest and writes none: it reports what compiled (the
    caller points the backend at a `scratch_view` of `cache_dir`, so compiles do not land there either).
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
