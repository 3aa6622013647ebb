"""What this machine has: the installed package versions (as plans, caches and manifests record them) and the
root of shapeplan's caches."""

from __future__ import annotations

import os
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path


def cache_root() -> Path:
    """$SHAPEPLAN_CACHE_DIR, or ~/.cache/shapeplan: a persistent folder (not /tmp, which boots may clear)."""
    return Path(os.environ.get("SHAPEPLAN_CACHE_DIR") or Path.home() / ".cache" / "shapeplan")


def installed_versions(names: Iterable[str]) -> dict[str, str | None]:
    """name -> installed version, None where the package is not installed."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def installed_only(names: Iterable[str]) -> dict[str, str]:
    """name -> version of the packages of `names` that are installed."""
    return {name: version for name, version in installed_versions(names).items() if version is not None}


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def process_count(name: str, value: str | int, *, cap: int, what: str) -> int:
    """A count of processes to fork (`value` of the setting `name`) as a whole number from 1 to `cap`, what this
    host has (`what` says so): anything else is refused before a process forks."""
    from .errors import UsageError

    try:
        count = int(str(value).strip())
    except ValueError:
        count = 0
    if not 1 <= count <= cap:
        raise UsageError(f"{name} must be a whole number of processes from 1 to {cap} ({what}), got {value!r}; "
                         f"set it within that range or leave it unset")
    return count


def workers_setting() -> int | None:
    """$SHAPEPLAN_WORKERS, the tokenizing processes `analyze` forks, checked against the host's cores; None unset."""
    value = os.environ.get("SHAPEPLAN_WORKERS")
    if value is None:
        return None
    return process_count("SHAPEPLAN_WORKERS", value, cap=usable_cores(), what="this host's cores")


def max_forks() -> int:
    """The most processes a run's own setting (TRL's dataset_num_proc) may fork here: a few per core."""
    return 4 * usable_cores()
