"""Importing a portable compile cache archive (cache/archive.py) into an empty cache dir, all or nothing.

Importing reads the archive's metadata and checks the environment and the size limits before extracting anything;
it extracts into a staging folder inside the target (so that the last step is a rename on one filesystem, which
also works on an empty mount point), checks every file against its checksum and the manifest, then moves the staged
files into the target and writes a completion marker last. An import killed before the marker leaves a staging
folder without a marker: `warm` refuses such a dir and the next import clears it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import CacheError, CacheMismatchError
from ..plan.io import write_atomic
from ..warm.manifest import MANIFEST, check_same_peft, machine_environment, mismatches, read_merged
from .archive import ArchiveInfo, extract, read_info
from .contents import IMPORT_MARKER, STAGING_PREFIX, cache_environment, is_temporary, locked_dir
from .limits import DEFAULT_LIMITS, Limits


def _clear_stale_import(target: Path) -> None:
    """Under the import lock: remove what a killed import left. Without its completion marker, everything in the
    folder was written by that import (an import starts on an empty folder and holds the lock throughout)."""
    stale = list(target.glob(f"{STAGING_PREFIX}*"))
    if not stale:
        return
    complete = (target / IMPORT_MARKER).exists()
    for path in target.iterdir() if not complete else stale:
        if path.name == "lost+found" and os.path.ismount(target):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def import_cache(archive: Path, cache_dir: Path, *, device: str | None = None, limits: Limits = DEFAULT_LIMITS,
                 follow_symlink: bool = False, run: dict[str, Any] | None = None) -> ArchiveInfo:
    """Extract `archive` into the empty or new `cache_dir` after checking that it matches this machine, and, given
    the warm environment of a `run`, that it was not warmed for that run's method and model with other PEFT
    settings only: all or nothing."""
    if cache_dir.is_symlink() and not follow_symlink:
        raise CacheError(f"{cache_dir} is a symbolic link (to {os.readlink(cache_dir)}); pass --follow-symlink to "
                         "import through it, or a real folder as --cache-dir")
    info = read_info(archive, limits)
    here = machine_environment(device or info.environment["compiler"].get("device", "cpu"))
    differences = mismatches(info.environment, here)
    if differences:
        raise CacheMismatchError(f"{archive} was compiled for another environment: {'; '.join(differences)}; "
                                 "warm this machine's own cache with `shapeplan warm` instead",
                                 differences=differences)
    target = cache_dir.resolve()
    if target.exists() and not target.is_dir():
        raise CacheError(f"{target} is not an empty folder; import into a new or empty --cache-dir")
    try:
        target.mkdir(parents=True)
        created = True
    except FileExistsError:
        created = False
    except OSError as exc:
        raise CacheError(f"cannot create {target} ({exc.strerror}); import into a writable --cache-dir") from None
    try:
        try:
            with locked_dir(target, "`shapeplan cache import`"):
                shapes = _import_locked(archive, info, target, limits, run)
        except PermissionError as exc:
            raise CacheError(f"cannot write into {target} ({exc.strerror}); import into a writable --cache-dir") \
                from None
    except BaseException:
        if created:
            with contextlib.suppress(OSError):  # not empty: a racing import took it over
                target.rmdir()
        raise
    return ArchiveInfo(info.path, info.environment, info.files, shapes, info.expanded)


def _import_locked(archive: Path, info: ArchiveInfo, target: Path, limits: Limits,
                   run: dict[str, Any] | None) -> int:
    """The import, holding the target's lock; returns the number of warmed shapes imported."""
    _clear_stale_import(target)
    # a freshly formatted ext4 volume holds lost+found at its root: that mount point counts as empty
    if any(p.name != "lost+found" or not os.path.ismount(target) for p in target.iterdir()):
        raise CacheError(f"{target} is not an empty folder; import into a new or empty --cache-dir")
    free = shutil.disk_usage(target).free
    if info.expanded > free:
        raise CacheError(f"{target} has {free} bytes free, {archive} needs {info.expanded}; free space or import "
                         "elsewhere")
    try:
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target))
    except OSError as exc:  # a read-only file system, a folder without write permission
        raise CacheError(f"cannot write into {target} ({exc.strerror}); import into a writable --cache-dir") from exc
    try:
        seen = extract(archive, info, staging, limits)
        missing = sorted(name for name in set(info.files) - seen if not is_temporary(name))
        if missing:
            raise CacheError(f"{archive} is damaged: {missing[0]} is listed but missing; export it again")
        try:
            environment, shapes = cache_environment(staging)
        except CacheError:
            raise CacheError(f"{archive} is damaged: its {MANIFEST} is missing, unreadable or holds several "
                             "environments; export it again") from None
        if environment != {"versions": info.environment["versions"], "compiler": info.environment["compiler"]}:
            raise CacheError(f"{archive} is damaged: its {MANIFEST} records another environment than the archive; "
                             "export it again")
        if run is not None:
            check_same_peft(read_merged(staging), run, str(archive))
        _move_in(staging, target, info)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return shapes


def _move_in(staging: Path, target: Path, info: ArchiveInfo) -> None:
    """Rename the staged entries into the target (one filesystem), then write the marker that makes them one step;
    on failure take back what was moved. (A kill -9 in between leaves the staging folder, which marks the import
    unfinished.)"""
    moved: list[Path] = []
    try:
        for entry in sorted(staging.iterdir()):
            os.rename(entry, target / entry.name)
            moved.append(target / entry.name)
        write_atomic(target / IMPORT_MARKER, json.dumps({"archive": info.path, "files": len(info.files)}) + "\n")
    except BaseException as exc:
        for path in moved:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CacheError(f"cannot finish the import into {target} ({exc.strerror}); nothing was imported, "
                             "check the folder and import again") from None
        raise


