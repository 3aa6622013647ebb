"""Warming on several cores at once: the tasks dealt (`shards.split`) to worker processes (one per NeuronCore
group) or to the ranks of `accelerate launch`, every process recording into the one manifest under a lock.

A process learns its part from its environment: SHAPEPLAN_WORKER=i/n (set by `shapeplan warm --workers n` for
each worker it starts), or RANK/WORLD_SIZE (set by `accelerate launch` / torchrun for each rank).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..adapters.host import usable_cores
from ..errors import UsageError

WORKER_ENV = "SHAPEPLAN_WORKER"
# Host memory one worker needs, in GiB: the Neuron compiler takes several GiB per graph of a 0.6B model.
WORKER_MEMORY_GIB = {"neuron": 24.0, "cuda": 8.0, "cpu": 2.0}


@dataclass(frozen=True, slots=True)
class Part:
    index: int
    count: int
    ranks: bool  # ranks of one data-parallel run (they step together), not independent workers


def current_part() -> Part | None:
    """This process's part of the warm-up, from its environment; None when it warms everything alone."""
    worker = os.environ.get(WORKER_ENV)
    if worker:
        index, _, count = worker.partition("/")
        return Part(_index(WORKER_ENV, index, count), _number(WORKER_ENV, count), ranks=False)
    world = _number("WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        return Part(_index("RANK", os.environ.get("RANK", "0"), str(world)), world, ranks=True)
    return None


def _number(name: str, text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise UsageError(f"{name}={os.environ.get(name)!r} is not a process count; set by `shapeplan warm "
                         "--workers` and `accelerate launch`, it is not set by hand: unset it")
    return int(text)


def _index(name: str, text: str, count: str) -> int:
    if not text.strip().isdigit() or int(text) >= _number(name, count):
        raise UsageError(f"{name}={os.environ.get(name)!r} is not a process index below {count}; set by `shapeplan "
                         "warm --workers` and `accelerate launch`, it is not set by hand: unset it")
    return int(text)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` + ".lock" (released by the kernel if the process dies)."""
    with open(f"{path}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def available_memory_gib() -> float:
    """MemAvailable from /proc/meminfo (inf where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024 ** 2
    except OSError:
        pass
    return float("inf")


def worker_count(requested: int, device: str, memory_gib: float | None) -> int:
    """`requested` workers, capped by host memory (`memory_gib` each, default per device) and, on neuron, by the
    visible logical NeuronCores (a core belongs to one process; a worker takes one)."""
    if requested < 1:
        raise UsageError(f"--workers must be at least 1, not {requested}")
    each = memory_gib if memory_gib is not None else WORKER_MEMORY_GIB[device]
    memory = available_memory_gib()
    count = max(1, min(requested, int(memory // each) if math.isfinite(memory) else requested))
    if device != "neuron":  # a neuron worker waits on its NeuronCore; a cpu or cuda one needs a core of its own
        count = min(count, usable_cores())
    if device == "neuron":
        from .backends.neuron import visible_cores

        cores = visible_cores()
        if cores is not None:
            count = max(1, min(count, len(cores)))
    return count


def aligned_groups(cores: Sequence[int], size: int) -> list[str]:
    """Every group of `size` (a power of two) cores among `cores` that starts at a multiple of `size`: the only
    groups whose cores can run collectives together (0,1 / 2,3 / 0-3, never 1,2); as NEURON_RT_VISIBLE_CORES."""
    if size < 1 or size & (size - 1):
        raise UsageError(f"a worker's NeuronCores must be a power of two, not {size}")
    present = set(cores)
    groups = []
    for first in sorted(present):
        if first % size == 0 and all(core in present for core in range(first, first + size)):
            groups.append(str(first) if size == 1 else f"{first}-{first + size - 1}")
    return groups


def core_groups(workers: int, cores_per_worker: int, cores: Sequence[int] | None = None) -> list[str]:
    """NEURON_RT_VISIBLE_CORES for each worker: aligned groups of `cores_per_worker` among `cores` (default: the
    visible cores, $NEURON_RT_VISIBLE_CORES when set, else 0, 1, ...)."""
    if cores is None:
        from .backends.neuron import visible_cores

        cores = visible_cores() or range(workers * cores_per_worker)
    groups = aligned_groups(cores, cores_per_worker)
    if len(groups) < workers:
        raise UsageError(f"the visible NeuronCores ({','.join(map(str, cores))}) hold {len(groups)} aligned group(s) "
                         f"of {cores_per_worker}, too few for {workers} workers; pass --workers {len(groups)} or widen "
                         "NEURON_RT_VISIBLE_CORES")
    return groups[:workers]


def worker_env(index: int, count: int, device: str, cores_per_worker: int) -> dict[str, str]:
    """What worker `index` of `count` runs with: its part and, on neuron, its own NeuronCores."""
    env = {WORKER_ENV: f"{index}/{count}"}
    if device == "neuron":
        from .backends.neuron import requested_cores

        requested = requested_cores()
        if requested is None:
            env["NEURON_RT_VISIBLE_CORES"] = core_groups(count, cores_per_worker)[index]
        else:  # NEURON_RT_NUM_CORES=n: n free cores the runtime picks; pinning 0..n-1 could take cores another
            # job holds, so each worker asks the runtime for its own share the same way
            if count * cores_per_worker > requested:
                raise UsageError(f"NEURON_RT_NUM_CORES={requested} asks for too few NeuronCores for {count} workers "
                                 f"of {cores_per_worker}; pass --workers {max(1, requested // cores_per_worker)}")
            env["NEURON_RT_NUM_CORES"] = str(cores_per_worker)
    return env


@dataclass(frozen=True, slots=True)
class ReportedTask:
    """A task as a worker's JSON report describes it (what the merged report prints)."""

    phase: str
    batch: int
    seq: int
    key: str

    @property
    def label(self) -> str:
        return f"{self.phase} ({self.batch}, {self.seq})"


def _die_with_parent() -> None:
    """Linux: a worker gets SIGKILL when the `shapeplan warm` that started it dies, even by kill -9."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_workers(plan_path: Path, *, count: int, device: str, cache_dir: Path, cores_per_worker: int = 1,
                shard: Any = None) -> Any:
    """Run `shapeplan warm --plan PLAN` in `count` worker processes at once, each on its share (and, on neuron, its
    own NeuronCores) of the plan or of `shard`'s share, all recording into the cache dir's (the shard's) manifest;
    return their reports merged into one (their warnings too, each once)."""
    import json
    import subprocess
    import sys

    from ..errors import ShapeplanError
    from .model import WarmReport, WarmResult

    command = [sys.executable, "-m", "shapeplan", "warm", "--plan", str(plan_path), "--device", device,
               "--cache-dir", str(cache_dir), "--json", *(["--shard", shard.label] if shard else [])]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent,
                              env={**os.environ, **worker_env(i, count, device, cores_per_worker)})
             for i in range(count)]
    outputs = [proc.communicate()[0] for proc in procs]
    reports = []
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        try:
            reports.append(json.loads(out))
        except json.JSONDecodeError:
            raise ShapeplanError(f"worker {i} exited with code {proc.returncode} without a report; its errors are "
                                 "above") from None
    results: dict[str, WarmResult] = {}
    for report in reports:
        for r in report["results"]:
            if r["status"] == "skipped" and r["key"] in results:
                continue  # every worker lists what the manifest already held; the worker that warmed it counts
            task = ReportedTask(r["phase"], r["batch"], r["seq"], r["key"])
            results[r["key"]] = WarmResult(task=task, status=r["status"], seconds=r["seconds"],
                                           counters=r["counters"], error=r.get("error"))
    # what each worker found (a cache dir per rank, a cache or lock dir on NFS, verify's key findings), each once:
    # every worker prepares the same cache dir, so most are said by all of them
    warnings = tuple(dict.fromkeys(w for report in reports for w in report.get("warnings", ())))
    first = reports[0]
    return WarmReport(results=tuple(results.values()), cache_dir=first["cache_dir"], device=first["device"],
                      environment=first["environment"], script_lines=tuple(first["script_lines"]), shard=shard,
                      warnings=warnings,
                      covered=tuple((c["phase"], c["batch"], c["seq"]) for c in first.get("covered", ())))
