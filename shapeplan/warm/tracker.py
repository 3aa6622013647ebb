"""Per-shape accounting of a warm-up: the time and compile-counter changes charged to each task, its status, and
its entry in the manifest."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from ..errors import CacheError
from .backends.base import Backend, counter_delta, new_keys
from .manifest import Manifest, environment_key
from .model import ManifestEntry, Task, WarmResult

TaskT = TypeVar("TaskT", bound=Task)


class Progress(Protocol):
    """Where a warm-up reports as it goes (the CLI draws a progress bar and a row per shape; a library caller may
    log, or pass None for silence)."""

    def begin(self, total: int) -> None:
        """`total` tasks are about to run."""
        ...

    def done(self, result: WarmResult) -> None:
        """A task finished (compiled, cached or failed)."""
        ...

    def close(self) -> None:
        """The warm-up ended, finished or not."""
        ...


class Tracker:
    """Times each task and reads the compile counters around it; records finished tasks in the manifest and reports
    them to `progress`. Where the backend names compile-cache keys (`compile_keys`: TorchNeuron's in-process cache
    entries), each task is also charged the keys first met while it ran, with their compile milliseconds, which the
    manifest records; with `warmed` (verify: per task key, the keys the warm-up recorded) `findings` holds what the
    backend says of them (`check_keys`). A failed task's error is the backend's explanation of it where it has one
    (`explain_failure`: a compiler killed or crashed)."""

    def __init__(self, backend: Backend, *, manifest: Manifest | None, environment: dict[str, Any],
                 total: int, progress: Progress | None = None, plan: str | None = None,
                 eager: bool = False, warmed: dict[str, dict[str, int | None]] | None = None) -> None:
        self.backend = backend
        self.plan = plan
        self.eager = eager  # nothing can compile: a finished task is `eager`, neither compiled nor cached
        self.manifest = manifest
        self.environment = environment
        self.env_key = environment_key(environment)
        self.results: dict[Task, WarmResult] = {}
        self.manifest_error: CacheError | None = None  # the manifest could not be written: the warm-up failed
        self._spent: dict[Task, tuple[float, dict[str, int]]] = {}
        self._mark: tuple[float, dict[str, int]] | None = None
        self.warmed = warmed
        self.keys: dict[str, dict[str, int | None]] = {}  # task key -> the keys it met first
        self.findings: list[str] = []
        self._read_keys = getattr(backend, "compile_keys", None)
        self._held: dict[str, int | None] = {}
        self.progress = progress
        if progress is not None:
            progress.begin(total)

    def start(self) -> None:
        """Begin counting: what ran before (loading, set-up) is charged to no task."""
        self._mark = (time.perf_counter(), self.backend.counters())
        self._held = self._keys_now()

    def _keys_now(self) -> dict[str, int | None]:
        return (self._read_keys() if self._read_keys is not None else None) or {}

    def charge(self, task: Task) -> None:
        """Charge the time and counter changes since the last mark to `task`."""
        assert self._mark is not None, "Tracker.start() must come first"
        now, counters = time.perf_counter(), self.backend.counters()
        seconds, delta = self._spent.get(task, (0.0, {}))
        step = counter_delta(self._mark[1], counters)
        merged = {k: delta.get(k, 0) + step.get(k, 0) for k in set(delta) | set(step)}
        self._spent[task] = (seconds + now - self._mark[0], merged)
        self._mark = (now, counters)
        if self._read_keys is not None:
            held = self._keys_now()
            new = new_keys(self._held, held)
            self._held = held
            if new:
                self.keys.setdefault(task.key, {}).update(new)

    def finish(self, task: Task) -> None:
        self.charge(task)
        seconds, delta = self._spent.pop(task)
        status = "eager" if self.eager else "compiled" if self.backend.compiled(delta) else "cached"
        self._done(WarmResult(task=task, status=status, seconds=seconds, counters=delta))
        warmed = (self.warmed or {}).get(task.key)
        check = getattr(self.backend, "check_keys", None)
        if warmed and check is not None:
            self.findings += check(task.label, warmed, self._held, self.keys.get(task.key, {}))

    def fail(self, task: Task, error: str) -> None:
        if self._mark is not None:
            self.charge(task)
        seconds, delta = self._spent.pop(task, (0.0, {}))
        explain = getattr(self.backend, "explain_failure", None)
        error = explain(error) if explain is not None else error
        self._done(WarmResult(task=task, status="failed", seconds=seconds, counters=delta, error=error))

    def steady(self, task: Task, *, micro_batches: int) -> None:
        """Record the seconds since the last mark, per micro-batch, as `task`'s steady-state seconds: a finished
        task run once more, so nothing compiles. Charged to no task's warm-up time."""
        assert self._mark is not None, "Tracker.start() must come first"
        now = time.perf_counter()
        result = replace(self.results[task], steady_seconds=(now - self._mark[0]) / micro_batches)
        self.results[task] = result
        self._mark = (now, self.backend.counters())
        self._held = self._keys_now()  # a finished shape run again: charged to no task
        self._record(result)

    def pending(self, tasks: Sequence[TaskT]) -> list[TaskT]:
        return [t for t in tasks if t not in self.results]

    def _done(self, result: WarmResult) -> None:
        self.results[result.task] = result
        self._record(result)
        if self.progress is not None:
            self.progress.done(result)

    def _record(self, result: WarmResult) -> None:
        if self.manifest is None:
            return
        if self.manifest_error is not None:  # a manifest that could not be written once is not written to again
            raise self.manifest_error
        try:
            self.manifest.record(ManifestEntry(environment=self.env_key, task=result.task.key, status=result.status,
                                               seconds=result.seconds, counters=result.counters,
                                               steady_seconds=result.steady_seconds, plan=self.plan,
                                               warmed_at=time.time(), keys=self.keys.get(result.task.key)),
                                 self.environment)
        except CacheError as exc:
            # kept for the runner to raise: a warmer that catches its tasks' errors must not turn it into a
            # failed shape (or, after the last shape, into success)
            self.manifest_error = exc
            raise

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
