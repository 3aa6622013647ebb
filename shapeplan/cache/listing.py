"""What cache dirs and stores hold, as data (like huggingface_hub's `scan_cache_dir`): per cache dir the plans
warmed into it, per store its pushes. `shapeplan cache ls` only formats these; `cache prune` picks from them."""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..warm.manifest import COMPILED, WARMED, other_build, read_merged
from .contents import cache_files, check_times


@dataclass(frozen=True, slots=True)
class CachedPlan:
    """The shapes of one plan warmed into a cache dir in one environment."""

    environment: str  # the manifest's environment key
    model: str | None
    method: str | None
    plan: str | None  # the plan's fingerprint (`plan_id`); None: warmed by a shapeplan that did not record it
    warmed: int  # compiled or read from the cache: code the cache holds
    failed: int
    last_warmed: float | None  # Unix time the last of its warmed shapes finished; None: not recorded
    shards: tuple[str, ...]  # "I/N" of the shard manifests holding its shapes ("-": the plain manifest)
    tasks: tuple[str, ...]  # the shapes' task keys
    eager: int = 0  # ran eager (cpu/cuda without torch_compile): nothing compiled or cached
    built_under: dict[str, str] | None = None  # a Neuron cache's torch-neuronx and neuronx-cc versions
    warning: str | None = None  # why this machine's build of them does not use it (`other_build`)

    def to_dict(self) -> dict[str, Any]:
        return {"environment": self.environment, "model": self.model, "method": self.method, "plan": self.plan,
                "warmed": self.warmed, "eager": self.eager, "failed": self.failed, "last_warmed": self.last_warmed,
                "shards": list(self.shards), "built_under": self.built_under, "warning": self.warning}


@dataclass(frozen=True, slots=True)
class CacheDirInfo:
    path: str
    files: int
    size_on_disk: int  # bytes of the cache's files
    plans: tuple[CachedPlan, ...]
    locks: int = 0  # lock files under the dir
    stale_locks: int = 0  # of those, the ones no process holds

    def to_dict(self) -> dict[str, Any]:
        return {"cache_dir": self.path, "files": self.files, "size_on_disk": self.size_on_disk,
                "locks": self.locks, "stale_locks": self.stale_locks, "plans": [p.to_dict() for p in self.plans]}


def scan_cache_dir(cache_dir: Path) -> CacheDirInfo:
    """The plans warmed into `cache_dir` (from all its manifest files), its files and their size, its lock files."""
    cache_dir = cache_dir.resolve()
    sections = read_merged(cache_dir).environments if cache_dir.is_dir() else {}
    check_times(sections, f"the manifest of {cache_dir}", "delete it to re-warm this cache dir")
    plans = warmed_plans(sections)
    files = list(cache_files(cache_dir)) if cache_dir.is_dir() else []
    locks = lock_files(cache_dir)
    return CacheDirInfo(str(cache_dir), len(files), sum(os.lstat(f).st_size for f in files), plans, len(locks),
                        sum(1 for lock in locks if _unheld(lock)))


def lock_files(folder: Path) -> list[Path]:
    """The lock files under `folder`: TorchNeuron's (`locks/<key>.lock`, sync mode's `<key>/locks/compile.lock`,
    when its lock dir is passed) and shapeplan's own."""
    return sorted(p for p in folder.rglob("*.lock") if p.is_file() and not p.is_symlink()) if folder.is_dir() else []


def _unheld(lock: Path, *, remove: bool = False) -> bool:
    """Whether no process holds `lock` (every holder takes an flock on it, released when it ends, even killed);
    with `remove`, unlinked while this process holds it."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held
        os.close(fd)
        return False
    try:
        if remove:
            lock.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)  # releases the flock


def warmed_plans(environments: dict[str, dict[str, Any]]) -> tuple[CachedPlan, ...]:
    """The plans of merged manifest sections (`read_merged(...).environments`), the most recently warmed first."""
    groups: dict[tuple[str, str | None], list[dict[str, Any]]] = {}
    for key, section in environments.items():
        for task, entry in section["shapes"].items():
            groups.setdefault((key, entry.get("plan")), []).append({**entry, "task": task})
    plans = []
    for (key, plan), entries in groups.items():
        environment = environments[key]["environment"]
        compiler = environment.get("compiler") or {}
        built = {k: str(compiler[k]) for k in ("torch-neuronx", "neuronx-cc") if k in compiler} \
            if compiler.get("backend") == "neuron" else None
        times = [e["warmed_at"] for e in entries
                 if e["status"] in WARMED and isinstance(e.get("warmed_at"), (int, float))]
        plans.append(CachedPlan(
            environment=key, model=environment.get("model"), method=environment.get("method"), plan=plan,
            warmed=sum(e["status"] in COMPILED for e in entries), eager=sum(e["status"] == "eager" for e in entries),
            failed=sum(e["status"] == "failed" for e in entries),
            last_warmed=max(times) if times else None,
            shards=tuple(sorted({e.get("shard") or "-" for e in entries})),
            tasks=tuple(e["task"] for e in entries), built_under=built,
            warning="; ".join(other_build(environment)) or None))
    plans.sort(key=lambda p: (-(p.last_warmed or 0), p.model or "", p.plan or ""))
    return tuple(plans)


@dataclass(frozen=True, slots=True)
class Pruning:
    """What `cache prune` removes from a cache dir: manifest entries (file, environment key, task key) and, when no
    warmed shape would remain, the compiled files (the cache does not record which shape compiled which file, so
    files shared by the shapes that stay cannot be told apart)."""

    cache_dir: str
    entries: tuple[tuple[str, str, str], ...]
    files: tuple[str, ...]
    freed: int  # bytes of `files`
    kept: int  # warmed shapes that stay
    locks: tuple[str, ...] = ()  # stale lock files, removed if no process holds them by then

    def to_dict(self) -> dict[str, Any]:
        return {"cache_dir": self.cache_dir, "entries": [list(e) for e in self.entries], "files": len(self.files),
                "freed": self.freed, "kept": self.kept, "locks": len(self.locks)}


def plan_pruning(cache_dir: Path, *, plans: frozenset[str] = frozenset(), before: float | None = None,
                 failed: bool = False, locks: bool = False) -> Pruning:
    """The entries of `plans` (fingerprints, or unique prefixes of them), those warmed before the Unix time
    `before` (an entry without its time counts as warmed when its manifest file was last written), with `failed`
    the failed ones; with `locks`, the lock files no process holds."""
    from ..warm.manifest import Manifest, manifest_files

    cache_dir = cache_dir.resolve()
    manifests = manifest_files(cache_dir) if cache_dir.is_dir() else []
    plans = frozenset(_one_plan_each(cache_dir, plans, manifests))
    entries, kept = [], 0
    for path in manifests:
        written = path.stat().st_mtime
        sections = Manifest(path).data["environments"]
        check_times(sections, f"manifest {path}", "delete it to re-warm this cache dir")
        for key, section in sections.items():
            for task, entry in section["shapes"].items():
                plan, at = entry.get("plan"), entry.get("warmed_at")
                when = written if at is None else at
                if plan in plans or (before is not None and when < before) or \
                        (failed and entry["status"] == "failed"):
                    entries.append((path.name, key, task))
                elif entry["status"] in WARMED:
                    kept += 1
    compiled = [f for f in cache_files(cache_dir)
                if f.parent != cache_dir or not f.name.startswith("shapeplan-manifest")]
    files = compiled if entries and not kept else []
    stale = [p for p in lock_files(cache_dir) if _unheld(p)] if locks else []
    return Pruning(str(cache_dir), tuple(entries), tuple(f.relative_to(cache_dir).as_posix() for f in files),
                   sum(f.stat().st_size for f in files), kept,
                   tuple(p.relative_to(cache_dir).as_posix() for p in stale))


def _one_plan_each(cache_dir: Path, prefixes: frozenset[str], manifests: list[Path]) -> set[str]:
    """The fingerprints `prefixes` name, each exactly one of the plans warmed into the dir: an empty prefix (every
    plan) and a prefix of two plans are refused, naming them, before anything is removed."""
    from ..errors import UsageError
    from ..warm.manifest import Manifest

    if not prefixes:
        return set()
    held = {entry.get("plan") for path in manifests for section in Manifest(path).data["environments"].values()
            for entry in section["shapes"].values()} - {None}
    chosen = set()
    for prefix in sorted(prefixes):
        if not prefix.strip():
            raise UsageError("an empty plan fingerprint matches every plan; pass one from the PLAN column of "
                             "`shapeplan cache ls` (or --older-than AGE)")
        found = sorted(p for p in held if p.startswith(prefix))
        if len(found) > 1:
            raise UsageError(f"fingerprint {prefix!r} matches {len(found)} plans in {cache_dir} "
                             f"({', '.join(found[:5])}{', ...' if len(found) > 5 else ''}); pass more of it")
        chosen.update(found)
    return chosen


def prune(pruning: Pruning) -> None:
    """Carry out `pruning`: each manifest file rewritten under its lock without the entries, then the files."""
    from ..warm.manifest import Manifest

    cache_dir = Path(pruning.cache_dir)
    by_file: dict[str, set[tuple[str, str]]] = {}
    for name, key, task in pruning.entries:
        by_file.setdefault(name, set()).add((key, task))
    for name, drop in by_file.items():
        Manifest(cache_dir / name).remove(drop)
    for relative in pruning.files:
        (cache_dir / relative).unlink(missing_ok=True)
    for relative in pruning.locks:
        _unheld(cache_dir / relative, remove=True)
    for parent in sorted({Path(r).parent for r in pruning.files}, key=lambda p: -len(p.parts)):
        for folder in [parent, *parent.parents][:-1]:  # up to, not including, the cache dir
            with contextlib.suppress(OSError):  # not empty
                (cache_dir / folder).rmdir()
