"""Where compiled code is cached: the default cache dir per compiler stack, and the checks `warm` (a dir it can
create and write) and `verify` (a dir that exists, read through a private scratch view) make of it."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..adapters.host import cache_root
from ..errors import CacheError
from ..plan.io import remove_stale

# Where Linux lists the mounted file systems, with their types (proc(5)).
MOUNTS = Path("/proc/mounts")
# File systems whose folders live on another host: NFS (EFS mounts as nfs4), Lustre (FSx), SMB, and FUSE mounts of
# object stores.
NETWORK_FILE_SYSTEMS = ("nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "beegfs", "gpfs", "9p",
                        "fuse.s3fs", "fuse.mountpoint-s3", "fuse.gcsfuse", "fuse.sshfs", "fuse.glusterfs")
# A path component that names a rank: rank_0, rank-3, rank1, local_rank_0, r2 (a number after "r" alone), or a
# launcher's rank variable left in the path ($LOCAL_RANK, ${RANK}, expanded per rank where the launcher expands it).
_RANK_VARIABLE = re.compile(r"[_-]?\$\{?(?:LOCAL_RANK|RANK|OMPI_COMM_WORLD(?:_LOCAL)?_RANK|SLURM_(?:LOCAL|PROC)ID)\}?")
_RANK_PREFIX = re.compile(r"(?:local[_-]?)?rank[_-]?|r", re.IGNORECASE)  # what a rank variable leaves behind
_RANK = re.compile(rf"(?:local[_-]?)?rank[_-]?\d+|r\d+|.*(?:{_RANK_VARIABLE.pattern}).*", re.IGNORECASE)


def rank_in_path(path: str | Path) -> str | None:
    """The component of `path` that names a rank (`rank_0`, `r3`, `$LOCAL_RANK`...), or None: a cache dir that holds
    one differs between the ranks of a run."""
    return next((part for part in Path(path).parts if _RANK.fullmatch(part)), None)


def without_rank(path: str | Path) -> Path:
    """`path` without what names a rank in it: where every rank could share one dir."""
    parts = [_RANK_VARIABLE.sub("", part) if _RANK_VARIABLE.search(part) else "" if _RANK.fullmatch(part) else part
             for part in Path(path).parts]
    return Path(*(part for part in parts if part and not _RANK_PREFIX.fullmatch(part)))


def network_file_system(path: Path) -> tuple[str, str] | None:
    """(mount point, file system type) of the network file system `path` (or the nearest folder of it that exists)
    lies on, from /proc/mounts; None on a local one, or where the mounts cannot be read."""
    try:
        lines = MOUNTS.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    existing = next((p for p in (path, *path.parents) if p.exists()), path)
    where = os.path.realpath(existing)
    best: tuple[str, str] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        # the mount point's blanks, tabs, newlines and backslashes are octal escapes (\040 ...)
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])
        under = where == point or where.startswith(point.rstrip("/") + "/")
        if under and (best is None or len(point) > len(best[0])):  # the innermost mount holds it
            best = (point, fields[2])
    return best if best is not None and best[1] in NETWORK_FILE_SYSTEMS else None


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
