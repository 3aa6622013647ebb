"""Fakes for testing code built on shapeplan (as httpx ships MockTransport): the warm runner's manifest, resume,
lockstep and report logic run in milliseconds, with no trainer and no compiler.

    backend = FakeBackend()
    backend.prepare(cache_dir)
    report = warm(plan, FakeWarmer(backend.meet), backend, cache_dir)
    backend.met          # every task key the warmer ran, in order

`FakeBackend` is a `Backend` whose compile cache is files in the cache dir; `FakeWarmer` runs each task by handing
its key to a `meet` callable (`FakeBackend.meet`, or `FakeNeuron.kernel` to go through the fake torch_neuronx).
`FakeNeuron`, `fake_env`, `version_site` and `xla_site` drive the fake torch_neuronx package in `SITE`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import first_line
from ..plan.model import Plan
from ..services.trainers import DEFAULT_METHOD
from ..warm.model import WarmTask
from ..warm.runner import tasks_from_plan
from ..warm.tracker import Tracker
from .neuron import SITE, FakeNeuron, fake_env, version_site, xla_site

__all__ = ["SITE", "FakeBackend", "FakeNeuron", "FakeWarmer", "fake_env", "version_site", "xla_site"]


class FakeBackend:
    """A compiler stack in memory: a key met for the first time in this "process" compiles unless the cache dir
    holds its file (a persistent hit); met again, it is an in-process hit, which the counters do not show."""

    name = "fake"
    device = "cpu"

    def __init__(self) -> None:
        self.cache_dir: Path | None = None
        self.met: list[str] = []
        self.configured: dict[str, Any] = {}
        self._memory: set[str] = set()
        self._counters = {"compiles": 0, "persistent_hits": 0}

    def prepare(self, cache_dir: Path, *, scratch: Path | None = None) -> None:
        self.cache_dir = cache_dir

    def configure(self, *, torch_compile: bool, graphs: int) -> None:
        self.configured = {"torch_compile": torch_compile, "graphs": graphs}

    def compiles(self, *, torch_compile: bool) -> bool:
        return True

    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def compiled(self, delta: Mapping[str, int]) -> bool:
        return delta.get("compiles", 0) > 0

    def hit(self, delta: Mapping[str, int]) -> bool:
        return delta.get("persistent_hits", 0) > 0

    def settings(self) -> dict[str, str]:
        return {"backend": self.name}

    def script_lines(self, cache_dir: Path, *, torch_compile: bool, graphs: int) -> tuple[str, ...]:
        return (f"export FAKE_CACHE_DIR={cache_dir}",)

    def meet(self, key: str) -> None:
        """Run the work named `key`: what a warmer's training step does to the real stack's cache."""
        assert self.cache_dir is not None, "FakeBackend.prepare() must come first"
        self.met.append(key)
        if key in self._memory:
            return
        self._memory.add(key)
        path = self.cache_dir / "fake" / hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        if path.is_file():
            self._counters["persistent_hits"] += 1
            return
        self._counters["compiles"] += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(key, encoding="utf-8")

    def restart(self) -> None:
        """A fresh process: the in-process tier is empty again (the cache dir stays)."""
        self._memory.clear()


class FakeWarmer:
    """Stands in for a method warmer: runs each task by passing its key to `meet`; the tasks whose keys are in
    `fail` raise instead, and so do those whose `meet` raises: each is recorded as failed with the error's first
    line, and the warmer goes on with the others, as the real ones do."""

    torch_compile = False

    def __init__(self, meet: Callable[[str], None], *, fail: Collection[str] = (),
                 environment: dict[str, Any] | None = None) -> None:
        self.meet = meet
        self.fail = fail
        self.env = environment or {"method": DEFAULT_METHOD, "model": "tiny"}
        self.warnings: list[str] = []
        self.shares: list[list[WarmTask]] | None = None
        self.runs: list[list[str]] = []  # the keys of the tasks each `run` was given

    def bind(self, plan: Plan) -> None:
        pass

    def tasks(self, plan: Plan) -> tuple[WarmTask, ...]:
        return tasks_from_plan(plan, eval_passes=1)

    def environment(self) -> dict[str, Any]:
        return dict(self.env)

    def run(self, tasks: Sequence[WarmTask], context: Sequence[WarmTask], tracker: Tracker) -> None:
        self.runs.append([t.key for t in tasks])
        tracker.start()
        for task in tasks:
            if task.key in self.fail:
                tracker.fail(task, "RuntimeError: boom")
                continue
            try:
                self.meet(task.key)
            except Exception as exc:  # as a real warmer records a shape whose step raised, and goes on
                tracker.fail(task, first_line(exc, named=True))
                continue
            tracker.finish(task)
