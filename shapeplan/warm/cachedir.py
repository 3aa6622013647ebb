"""Where compiled code is cached: the default cache dir per compiler stack, and the checks `warm` (a dir it can
create and write) and `verify` (a dir that exists, read through a private scratch view) make of it."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..adapters.host import cache_root
from ..errors import CacheError
from ..plan.io import remove_stale


def default_cache_dir(device: str) -> Path:
    """The compile cache of `device`'s compiler stack, under the cache root."""
    return cache_root() / ("neuron" if device == "neuron" else f"inductor-{device}")


def cache_dir_path(path: Path) -> Path:
    """`path` made absolute, its symbolic links resolved; a loop of links is refused."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:  # RuntimeError: Python 3.11's "Symlink loop"
        raise CacheError(f"cache dir {path} is a loop of symbolic links; pass a real folder with --cache-dir") \
            from exc


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
    if not os.access(existing, os.W_OK | os.X_OK):  # a read-only file system refuses even root here
        where = "" if existing == path else f" (its folder {existing} is not)"
        raise CacheError(f"cache dir {path} is not writable{where}; pass a writable folder with --cache-dir")


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
