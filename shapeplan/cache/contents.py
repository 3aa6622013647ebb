"""What a compile cache dir holds, as export, merge, push and pull see it: its files (without locks, temporaries and
the staging folders below), a checksum per file, the one environment its manifests record; and the guards of a
folder being filled: the names imports and pulls stage under, the lock on the folder, the refusal of an
unfinished fill."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import CacheError
from ..warm.manifest import COMPILED, MANIFEST, read_merged

CHUNK = 1 << 20  # bytes read at a time, hashing or copying
# In an imported cache dir: the folder a running (or killed) import stages into, and the marker a finished import
# writes last.
STAGING_PREFIX = ".shapeplan-importing-"
IMPORT_MARKER = ".shapeplan-import-complete"
# A `cache pull` (cache/store.py) stages into `PULL_STAGING<pid>-*` and, once every file is checked, writes
# `PULL_JOURNAL` there before moving them in: a staging folder with a journal is a pull that must be finished.
PULL_STAGING = ".shapeplan-pulling-"
PULL_JOURNAL = "journal.json"
# In-flight writes: TorchNeuron's `.tmp.XXXXXX` in a shard dir (renamed into place when done), `*.tmp` of its Python
# compile path and of shapeplan's own atomic writes.
_TEMPORARY = re.compile(r"(\.tmp\.[A-Za-z0-9_]{6}|\.tmp)$")


def is_temporary(name: str) -> bool:
    return bool(_TEMPORARY.search(name))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def cache_files(cache_dir: Path) -> Iterator[Path]:
    """The cache's files, sorted; lock files, in-progress temporaries, empty NEFFs and imports' and pulls' staging
    are left out."""
    for path in sorted(cache_dir.rglob("*")):
        if path.name == IMPORT_MARKER or any(part.startswith((STAGING_PREFIX, PULL_STAGING)) for part in path.parts):
            continue
        if path.is_symlink():
            raise CacheError(f"{path} is a symbolic link; a cache to export must hold only files and folders")
        name = path.name
        if path.is_file() and not (name.endswith(".lock") or name.startswith(".shapeplan-probe-")
                                   or is_temporary(name) or _empty_neff(path)):
            yield path


def _empty_neff(path: Path) -> bool:
    """A NEFF of size 0 (a truncated copy): TorchNeuron reads it as a miss (PersistentCacheBackend.cpp:89-94), so it
    is not shipped."""
    return path.suffix == ".neff" and path.stat().st_size == 0


# The latest Unix time a manifest may record: the last second of the year 9999, the last a listing can show as a date.
LATEST_TIME = 253402300799


def is_unix_time(value: Any) -> bool:
    """A Unix time as a warm-up or a push records it: a number from the epoch to LATEST_TIME (not NaN, not 1e300)."""
    return type(value) in (int, float) and 0 <= value <= LATEST_TIME


def check_times(sections: dict[str, dict[str, Any]], source: str, fix: str) -> None:
    """Refuse manifest sections (`read_merged(...).environments`) whose shape records a warmed_at that is no Unix
    time, hand-edited or damaged: `cache ls` shows it as a date and `cache prune --older-than` compares it."""
    for section in sections.values():
        for task, entry in section["shapes"].items():
            at = entry.get("warmed_at")
            if at is not None and not is_unix_time(at):
                raise CacheError(f"{source} records warmed_at {at!r} for {task}, not a Unix time; {fix}")


def cache_environment(cache_dir: Path) -> tuple[dict[str, Any], int]:
    """The one environment (versions, compiler settings) the cache dir's shapes were warmed in, and their count,
    from all its manifest files (a shard's too)."""
    merged = read_merged(cache_dir)
    if not merged.files:
        raise CacheError(f"{cache_dir} has no {MANIFEST}; warm it with `shapeplan warm --cache-dir {cache_dir}` first")
    sections = merged.environments.values()
    found = {json.dumps({"versions": s["environment"].get("versions"), "compiler": s["environment"].get("compiler")},
                        sort_keys=True) for s in sections}
    if len(found) != 1:
        raise CacheError(f"{cache_dir} holds shapes warmed with {len(found)} different package versions or compiler "
                         "settings; export a cache dir warmed in one environment")
    warmed = sum(1 for s in sections for entry in s["shapes"].values() if entry["status"] in COMPILED)
    return json.loads(found.pop()), warmed



def refuse_incomplete_import(cache_dir: Path) -> None:
    """Refuse a cache dir an import is filling, or was filling when it was killed, or a pull was moving files into
    (a pull still downloading leaves the cache as it was: it is not refused)."""
    if cache_dir.is_dir() and not (cache_dir / IMPORT_MARKER).exists() \
            and any(cache_dir.glob(f"{STAGING_PREFIX}*")):
        raise CacheError(f"{cache_dir} holds an unfinished `shapeplan cache import` (running, or killed); wait for "
                         "it, or run the import again, which clears it")
    if cache_dir.is_dir() and any(cache_dir.glob(f"{PULL_STAGING}*/{PULL_JOURNAL}")):
        raise CacheError(f"{cache_dir} holds an unfinished `shapeplan cache pull` (moving files in, or killed "
                         "doing so); wait for it, or run the pull again, which finishes it")



@contextlib.contextmanager
def locked_dir(target: Path, holder: str) -> Iterator[None]:
    """An exclusive lock on the target folder itself (no lock file: a refused import leaves the folder as it was),
    released by the kernel if the process dies. `holder` names the command, for the refusal."""
    busy = CacheError(f"another {holder} is filling {target}; wait for it to finish")
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(target))
        except FileNotFoundError:
            same = False
        if not same:  # the import we waited on failed and removed the folder it had created
            raise busy
        yield
    finally:
        os.close(fd)


