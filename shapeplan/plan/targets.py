"""Where a file the user names for output may be written (`analyze -o`, `warm --env-file`, `doctor --report`,
`guard --record`, `cache export|merge -o`), checked before the command's work starts, and the one way to write it.

A regular file (new or existing) is written atomically, through a link to the file it names; a character device
(/dev/null, /dev/stdout) or a FIFO is written in place, never replaced by a regular file. Refused (UsageError,
exit 2): a folder, a block device or socket, a file the command reads (the plan, a config, a dataset), a compile
cache's own files (its manifests, anything inside the cache dir the command uses or inside any folder that holds a
shapeplan manifest) and a store's manifests. A folder that does not exist or takes no new file is exit 1, as a
failed write is.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from ..errors import PlanFileError, ShapeplanError, UsageError
from .io import dumps, temp_file, write_atomic
from .model import Plan

# The names of shapeplan's own files in a cache dir: `shapeplan-manifest.json` (warm/manifest.py), its shard files,
# their locks, and the `.shapeplan-*` staging folders and markers of imports and pulls (cache/contents.py).
_OWN_PREFIXES = ("shapeplan-manifest", ".shapeplan-")


def _is_cache_dir(folder: Path) -> bool:
    return os.path.isfile(folder / "shapeplan-manifest.json")


def _is_store_manifests(folder: Path) -> bool:
    return folder.name == "manifests" and os.path.isdir(folder.parent / "objects")


def check_output(path: str | os.PathLike[str], option: str, *, inputs: Iterable[str | os.PathLike[str] | None] = (),
                 cache_dirs: Iterable[str | os.PathLike[str] | None] = (), regular_only: bool = False,
                 probe: bool = True, what: str | None = None) -> Path:
    """The file `option`'s output goes to (a link resolved), checked before any work; see the module's docstring.
    `inputs` are the files the command reads, `cache_dirs` the cache dirs it uses (None entries are skipped).
    `regular_only`: a device or FIFO is refused too (an archive is renamed into place, never streamed); `probe`:
    check that the folder takes a new file (off where the writer makes the folder itself); `what` names the output
    in a failed write ("plan": "cannot write plan to PATH")."""
    text = os.fspath(path)
    if not text.strip():
        raise UsageError(f"{option} is empty; pass the path of a file to write")
    if "\0" in text:
        raise UsageError(f"{option} {text!r} holds a NUL byte; pass the path of a file to write")
    refuse = f"{option} {text}"
    unwritable = f"{what} to {text}" if what else refuse
    try:
        found = os.stat(text)  # through links, as the kernel opens it (/dev/stdout on a pipe has no real path)
    except FileNotFoundError:
        found = None
    except OSError as exc:
        raise ShapeplanError(f"cannot write {unwritable}: {exc.strerror}; choose a writable path") from None
    # a regular file is renamed onto: the file a link names, not the link; a device or FIFO is opened as given
    real = Path(os.path.realpath(text)) if found is None or stat.S_ISREG(found.st_mode) else Path(text)
    if found is not None:
        if stat.S_ISDIR(found.st_mode):
            raise UsageError(f"{refuse} is a folder; pass the path of a file in it")
        if regular_only and not stat.S_ISREG(found.st_mode):
            raise UsageError(f"{refuse} is not a regular file (a device or FIFO); pass the path of a file")
        if not (stat.S_ISREG(found.st_mode) or stat.S_ISCHR(found.st_mode) or stat.S_ISFIFO(found.st_mode)):
            raise UsageError(f"{refuse} is a block device or socket, which the output would destroy; pass a file")
        for source in inputs:
            if source is not None and _same(found, source):
                raise UsageError(f"{refuse} is {os.fspath(source)}, which this command reads; write it to another "
                                 "file")
    if found is None or stat.S_ISREG(found.st_mode):
        if real.name.startswith(_OWN_PREFIXES) or any(_is_store_manifests(f) for f in real.parents):
            raise UsageError(f"{refuse} is a shapeplan manifest; write it to another file")
        for folder in cache_dirs:
            if folder is not None:
                own = Path(os.path.realpath(folder))
                if real == own or own in real.parents:
                    raise UsageError(f"{refuse} is inside the cache dir {own}, among its own files; write it "
                                     "outside the cache dir")
        if held := next((f for f in real.parents if _is_cache_dir(f)), None):
            raise UsageError(f"{refuse} is inside the compile cache {held}, among its own files; write it outside "
                             "the cache dir")
        if probe:
            _probe_folder(real, unwritable)
    return real


def named_files(args: Iterable[str | None]) -> list[str]:
    """The existing files a command line names (an argument, or the value of `--option=value`): the inputs an
    output may not replace."""
    found = []
    for arg in args:
        if arg is None:
            continue
        for candidate in (arg, arg.partition("=")[2]):
            try:
                if candidate and os.path.isfile(candidate):
                    found.append(candidate)
            except (OSError, ValueError):
                continue
    return found


def _same(found: os.stat_result, source: str | os.PathLike[str]) -> bool:
    try:
        return os.path.samestat(found, os.stat(source))
    except (OSError, ValueError):
        return False


def _probe_folder(real: Path, refuse: str) -> None:
    """The folder takes a new file (the temporary an atomic write renames): an unwritable target fails now, not
    after the command's minutes of work."""
    if not real.parent.is_dir():
        raise ShapeplanError(f"cannot write {refuse}: its folder {real.parent} does not exist; create it or choose "
                             "another path")
    try:
        fd, tmp = temp_file(real)
    except OSError as exc:
        raise ShapeplanError(f"cannot write {refuse}: {exc.strerror}; choose a writable path") from None
    os.close(fd)
    os.unlink(tmp)


def write_output(path: str | os.PathLike[str], text: str, option: str, *,
                 inputs: Iterable[str | os.PathLike[str] | None] = (),
                 cache_dirs: Iterable[str | os.PathLike[str] | None] = (), what: str | None = None) -> None:
    """Write `text` to the output `path` names (checked again: it may have changed during the work). OSError from
    the write itself is left to the caller, which names its option's fix."""
    real = check_output(path, option, inputs=inputs, cache_dirs=cache_dirs, what=what)
    try:
        special = not stat.S_ISREG(os.stat(real).st_mode)
    except FileNotFoundError:
        special = False
    if not special:
        write_atomic(real, text)
        return
    try:  # a FIFO nobody reads would block forever: refused instead
        fd = os.open(real, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise ShapeplanError(f"cannot write {what + ' to' if what else option} {os.fspath(path)}: it is a FIFO "
                                 "nobody reads; start its reader first") from None
        raise
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        with os.fdopen(fd, "w", encoding="utf-8", closefd=False) as out:
            out.write(text)
    finally:
        os.close(fd)


def write_plan_output(plan: Plan, path: str | os.PathLike[str],
                      inputs: Iterable[str | os.PathLike[str] | None] = ()) -> None:
    """`-o PLAN`: the plan through `write_output`."""
    try:
        write_output(path, dumps(plan), "-o", inputs=inputs, what="plan")
    except OSError as exc:
        raise PlanFileError(f"cannot write plan to {os.fspath(path)}: {exc.strerror}; choose a writable path with "
                            "-o") from exc
