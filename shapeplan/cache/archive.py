"""Portable compile caches, for baking into machine images: a warmed cache dir with its manifest, a checksum per
file and the environment its code was compiled in, as one .tar.gz; written (`export_cache`), merged from shards
(`merge_archives`), and read with bounds on every size (`read_info`, `archived_plans`, `extract`). Importing one
into a cache dir: cache/archive_import.py.

The archive holds `shapeplan-archive.json` first (schema, environment, sha256 of every file, their expanded total),
then the cache dir's files under `cache/`.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import CacheError, CacheMismatchError
from ..plan.io import remove_stale, temp_file
from ..warm.manifest import MANIFEST, mismatches, read_merged
from .contents import (
    CHUNK,
    IMPORT_MARKER,
    STAGING_PREFIX,
    cache_environment,
    cache_files,
    check_times,
    is_temporary,
    refuse_incomplete_import,
    sha256_of,
)
from .limits import DEFAULT_LIMITS, Limits

ARCHIVE_META = "shapeplan-archive.json"
ARCHIVE_SCHEMA = 2  # 2: records the expanded total
PREFIX = "cache"
_HEADER_LIMIT = 1 << 20  # a pax or GNU long-name header holds a path, never more than this


@dataclass(frozen=True, slots=True)
class ArchiveInfo:
    path: str
    environment: dict[str, Any]  # {"versions": {...}, "compiler": backend settings}
    files: dict[str, str]  # path under the cache dir -> sha256
    shapes: int  # warmed shapes the manifest records
    expanded: int = 0  # the files' total size in bytes

    def to_dict(self) -> dict[str, Any]:
        return {"archive": self.path, "environment": self.environment, "files": len(self.files),
                "shapes": self.shapes}

def export_cache(cache_dir: Path, archive: Path) -> ArchiveInfo:
    """Write `cache_dir` (a warmed cache) to `archive` atomically."""
    cache_dir = cache_dir.resolve()
    refuse_incomplete_import(cache_dir)
    environment, shapes = cache_environment(cache_dir)
    check_times(read_merged(cache_dir).environments, f"the manifest of {cache_dir}",
                "delete it to re-warm this cache dir")
    paths = list(cache_files(cache_dir))
    files = {path.relative_to(cache_dir).as_posix(): sha256_of(path) for path in paths}
    expanded = sum(path.stat().st_size for path in paths)
    _write_archive(cache_dir, environment, files, expanded, archive)
    return ArchiveInfo(str(archive), environment, files, shapes, expanded)


def _write_archive(cache_dir: Path, environment: dict[str, Any], files: dict[str, str], expanded: int,
                   archive: Path) -> None:
    """`files` of `cache_dir` (path -> sha256), behind their metadata, to `archive` atomically."""
    meta = json.dumps({"schema": ARCHIVE_SCHEMA, "environment": environment, "files": files, "expanded": expanded},
                      indent=2, sort_keys=True).encode()
    try:
        archive.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_file(archive)
    except OSError as exc:
        raise CacheError(f"cannot write {archive}: {exc.strerror}; choose a writable path with -o") from exc
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            entry = tarfile.TarInfo(ARCHIVE_META)
            entry.size = len(meta)
            entry.mode = 0o644
            tar.addfile(entry, io.BytesIO(meta))
            for name, sha in files.items():
                _add_unchanged(tar, cache_dir / name, f"{PREFIX}/{name}", sha)
        os.replace(tmp, archive)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CacheError(f"cannot write {archive}: {exc.strerror}; choose a writable path with -o") from exc
        raise


def _add_unchanged(tar: tarfile.TarFile, path: Path, arcname: str, sha: str) -> None:
    """Add `path` to `tar` as it was hashed (`sha`): a file written to since (a warm-up still compiling into the
    cache dir) is refused, so that an export is a snapshot that imports, never an archive its own checksums fail."""
    with open(path, "rb") as handle:
        entry = tar.gettarinfo(arcname=arcname, fileobj=handle)
        digest = hashlib.sha256()

        class Hashing(io.RawIOBase):
            def readable(self) -> bool:
                return True

            def readinto(self, buffer: Any) -> int:
                data = handle.read(len(buffer))
                digest.update(data)
                buffer[:len(data)] = data
                return len(data)

        try:
            tar.addfile(entry, Hashing())
        except OSError as exc:
            if exc.errno is None:  # tarfile's "unexpected end of data": the file shrank
                raise _changed(path) from exc
            raise
        if digest.hexdigest() != sha or os.fstat(handle.fileno()).st_size != entry.size:
            raise _changed(path)


def _changed(path: Path) -> CacheError:
    return CacheError(f"{path} changed while it was exported (a warm-up still writing into the cache dir?); export "
                      "again once nothing writes there")


MERGE_STAGING = ".shapeplan-merging-"


def _same_build(name: str, first: ArchiveInfo, other: ArchiveInfo) -> bool:
    """Whether `name` is a native object both parts built from one source: Inductor names it after its source's hash
    (`<hash>.main.so` next to `<hash>.main.cpp`), and the C++ compiler does not rebuild it byte for byte."""
    source = name.removesuffix(".so") + ".cpp"
    return name.endswith(".so") and source in first.files and first.files[source] == other.files.get(source)


def merge_archives(parts: list[Path], output: Path, limits: Limits = DEFAULT_LIMITS) -> ArchiveInfo:
    """The archives of several shards as one `output`, written atomically: every part from one environment (else
    CacheMismatchError), no path with two contents (else CacheError, nothing written), every file checked against
    its checksum as it is extracted into a staging folder next to `output`."""
    infos = [read_info(part, limits) for part in parts]
    environment = infos[0].environment
    for info in infos[1:]:
        differences = mismatches(environment, info.environment)
        if differences:
            raise CacheMismatchError(f"{info.path} was compiled in another environment than {infos[0].path}: "
                                     f"{'; '.join(differences)}; merge only archives of one environment",
                                     differences=differences)
    files: dict[str, str] = {}
    owner: dict[str, ArchiveInfo] = {}
    for info in infos:
        for name, digest in info.files.items():
            if files.setdefault(name, digest) != digest and not _same_build(name, owner[name], info):
                raise CacheError(f"{info.path} and {owner[name].path} hold different contents for {name}; nothing "
                                 "was written: merge archives of disjoint shards (`warm --shard I/N` per part)")
            owner.setdefault(name, info)
    expanded = sum(info.expanded for info in infos)
    if len(files) > limits.max_files or expanded > limits.max_bytes:
        raise CacheError(f"the merged archive would exceed the limits ({len(files)} files, {expanded} bytes); raise "
                         "--max-gib / --max-files if it is genuine")
    folder = output.parent if str(output.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale(folder, MERGE_STAGING)  # staging folders of killed merges
        staging = Path(tempfile.mkdtemp(prefix=f"{MERGE_STAGING}{os.getpid()}-", dir=folder))
    except OSError as exc:
        raise CacheError(f"cannot write {output}: {exc.strerror}; choose a writable path with -o") from exc
    try:
        for info in reversed(infos):  # the first part's build of a native object (`_same_build`) is written last
            missing = set(info.files) - extract(Path(info.path), info, staging, limits)
            if any(not is_temporary(name) for name in missing):
                raise CacheError(f"{info.path} is damaged: {sorted(missing)[0]} is listed but missing; export it "
                                 "again")
        merged_environment, shapes = cache_environment(staging)
        if merged_environment != {"versions": environment["versions"], "compiler": environment["compiler"]}:
            raise CacheError(f"the parts' {MANIFEST} files record another environment than the archives; export "
                             "them again")
        present = {name: digest for name, digest in files.items() if (staging / name).is_file()}
        total = sum((staging / name).stat().st_size for name in present)
        _write_archive(staging, environment, present, total, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ArchiveInfo(str(output), environment, present, shapes, total)


class _Counted(io.RawIOBase):
    """The decompressed stream, refusing to yield more than `cap` bytes in all (so no header or member can make an
    import read, hold or write more than the limits allow)."""

    def __init__(self, source: gzip.GzipFile, cap: int, archive: Path) -> None:
        self.source, self.cap, self.archive, self.count = source, cap, archive, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        size = self.cap - self.count + 1 if size < 0 else min(size, self.cap - self.count + 1)
        data = self.source.read(size)
        self.count += len(data)
        if self.count > self.cap:
            raise CacheError(f"{self.archive} expands beyond the import limits; raise --max-gib / --max-files if "
                             "it is genuine")
        return data

    def drain(self) -> None:
        """Read to the end of the gzip stream, which checks its CRC and length: a truncated stream raises."""
        while self.read(CHUNK):
            pass


_EXTENDED_HEADERS = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                     tarfile.SOLARIS_XHDTYPE)


class _BoundedTarInfo(tarfile.TarInfo):
    def _proc_member(self, tar: Any) -> tarfile.TarInfo:
        # tarfile reads a pax or GNU long-name header whole into memory before handing out its member
        if self.type in _EXTENDED_HEADERS and self.size > _HEADER_LIMIT:
            raise tarfile.HeaderError(f"a {self.size}-byte extended header")
        return super()._proc_member(tar)  # type: ignore[misc]  # tarfile's private hook, unchanged since Python 3.2


@contextlib.contextmanager
def _open(archive: Path, cap: int) -> Iterator[tuple[tarfile.TarFile, _Counted]]:
    """The archive as a tar stream (read front to back, once) over at most `cap` decompressed bytes."""
    try:
        raw = open(archive, "rb")  # noqa: SIM115  # closed by the `with` below; only the open's errors differ
    except FileNotFoundError:
        raise CacheError(f"archive {archive} does not exist; pass a file written by `shapeplan cache export`") \
            from None
    except OSError as exc:
        raise CacheError(f"cannot read archive {archive} ({exc.strerror}); pass a readable file") from None
    with raw, gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
        counted = _Counted(unzipped, cap, archive)
        with _stream_errors(archive):
            tar = tarfile.open(fileobj=counted, mode="r|", tarinfo=_BoundedTarInfo)  # noqa: SIM115  # `with tar` below
        with tar:
            yield tar, counted


@contextlib.contextmanager
def _stream_errors(archive: Path) -> Iterator[None]:
    """What reading the archive's gzip and tar stream raises, as one line each."""
    try:
        yield
    except EOFError as exc:  # a gzip stream cut short
        raise CacheError(f"{archive} is damaged ({exc}); export it again") from None
    except gzip.BadGzipFile:
        raise CacheError(f"{archive} is not a shapeplan cache archive (not a gzip file); pass a file written by "
                         "`shapeplan cache export`") from None
    except (OSError, tarfile.TarError) as exc:
        raise CacheError(f"{archive} is not a shapeplan cache archive ({exc}); pass a file written by "
                         "`shapeplan cache export`") from None


def _read_meta(tar: tarfile.TarFile, archive: Path, limits: Limits) -> ArchiveInfo:
    """The archive's first member, checked: its size, encoding, JSON structure and the limits it declares."""
    not_ours = (f"{archive} is not a shapeplan cache archive (no readable {ARCHIVE_META}); pass a file written by "
                "`shapeplan cache export`")
    first = tar.next()
    if first is None or first.name != ARCHIVE_META or not first.isfile():
        raise CacheError(not_ours)
    if first.size > limits.max_metadata:
        raise CacheError(f"{archive} has a {first.size}-byte {ARCHIVE_META}, over the {limits.max_metadata}-byte "
                         "limit; raise --max-metadata-mib if it is genuine", limit=limits.max_metadata,
                         value=first.size)
    handle = tar.extractfile(first)
    try:
        meta = json.loads(handle.read().decode("utf-8")) if handle is not None else None
    except ValueError:  # bad JSON or not UTF-8
        raise CacheError(not_ours) from None
    if not isinstance(meta, dict) or "schema" not in meta:
        raise CacheError(not_ours)
    if meta["schema"] != ARCHIVE_SCHEMA:
        raise CacheError(f"{archive} has archive schema {meta['schema']!r}, this shapeplan reads {ARCHIVE_SCHEMA}; "
                         "export it again with this version")
    environment, files, expanded = meta.get("environment"), meta.get("files"), meta.get("expanded")
    if not (isinstance(environment, dict) and all(isinstance(environment.get(k), dict)
                                                  for k in ("versions", "compiler"))
            and isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
            and type(expanded) is int and expanded >= 0):
        raise CacheError(f"{archive} has a malformed {ARCHIVE_META} (environment, files or expanded size); export "
                         "it again")
    if len(files) > limits.max_files:
        raise CacheError(f"{archive} holds {len(files)} files, over the limit of {limits.max_files}; raise "
                         "--max-files if it is genuine", limit=limits.max_files, value=len(files))
    if expanded > limits.max_bytes:
        raise CacheError(f"{archive} expands to {expanded} bytes, over the limit of {limits.max_bytes}; raise "
                         "--max-gib if it is genuine", limit=limits.max_bytes, value=expanded)
    return ArchiveInfo(str(archive), environment, files, shapes=0, expanded=expanded)


def _cap(limits: Limits) -> int:
    """Decompressed bytes an archive within `limits` can hold: metadata, files, and per member two 512-byte
    headers, padding and a pax header."""
    return limits.max_metadata + limits.max_bytes + (limits.max_files + 1) * 4096 + 20 * 512


def read_info(archive: Path, limits: Limits = DEFAULT_LIMITS) -> ArchiveInfo:
    """The archive's environment and file list (its first member), without extracting anything."""
    with _stream_errors(archive), _open(archive, _cap(limits)) as (tar, _):
        return _read_meta(tar, archive, limits)


def archived_plans(archive: Path, limits: Limits = DEFAULT_LIMITS) -> dict[str, dict[str, Any]]:
    """The merged manifest sections of the archive's manifest files (read from the stream, nothing extracted but
    them, into a temporary folder), for `cache inspect`."""

    with tempfile.TemporaryDirectory(prefix="shapeplan-inspect-") as folder, _stream_errors(archive), \
            _open(archive, _cap(limits)) as (tar, _):
        _read_meta(tar, archive, limits)
        for member in tar:
            relative = _member_path(member, archive)
            if relative is not None and relative.startswith("shapeplan-manifest") and "/" not in relative:
                if member.size > limits.max_metadata:
                    raise CacheError(f"{archive} has a {member.size}-byte {relative}, over the limit; raise "
                                     "--max-metadata-mib if it is genuine")
                source = tar.extractfile(member)
                assert source is not None
                (Path(folder) / relative).write_bytes(source.read())
        sections = read_merged(Path(folder)).environments
    check_times(sections, f"the manifest in {archive}", "export the archive again")
    return sections


def _member_path(member: tarfile.TarInfo, archive: Path) -> str | None:
    """The cache-relative path of a file member; None for the metadata and folders; refuses anything that would
    land outside the cache (absolute paths, '..') and links or special files."""
    if member.name == ARCHIVE_META:
        return None
    name = PurePosixPath(member.name)
    if name.is_absolute() or ".." in name.parts or name.parts[:1] != (PREFIX,):
        raise CacheError(f"{archive} has a member outside the cache ({member.name}); refusing it")
    if any(part.startswith(STAGING_PREFIX) or part == IMPORT_MARKER for part in name.parts):
        raise CacheError(f"{archive} has a member with a name shapeplan reserves ({member.name}); refusing it")
    if member.isdir():
        return None
    if not member.isfile() or member.issparse() or len(name.parts) < 2:
        raise CacheError(f"{archive} has a link or special file ({member.name}); refusing it")
    return PurePosixPath(*name.parts[1:]).as_posix()

def extract(archive: Path, info: ArchiveInfo, staging: Path, limits: Limits) -> set[str]:
    """Every file member, written under `staging` with its mode, checked against its checksum; never more bytes
    than the archive declares or more members than the limit."""
    seen: set[str] = set()
    written = members = 0
    try:
        with _open(archive, _cap(limits)) as (tar, counted):
            if _read_meta(tar, archive, limits) != info:
                raise CacheError(f"{archive} changed while it was imported; import it again")
            for member in tar:
                members += 1
                if members > limits.max_files * 2:  # files and their folders
                    raise CacheError(f"{archive} has more than {limits.max_files * 2} members; raise --max-files "
                                     "if it is genuine")
                relative = _member_path(member, archive)
                if relative is None or is_temporary(relative):  # an older export may hold temporaries
                    continue
                expected = info.files.get(relative)
                if expected is None or relative in seen:
                    raise CacheError(f"{archive} is damaged: {relative} is not in its checksum list; export it again")
                written += member.size
                if written > info.expanded:
                    raise CacheError(f"{archive} is damaged: its files expand beyond the {info.expanded} bytes it "
                                     "declares; export it again")
                destination = staging / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()
                source = tar.extractfile(member)
                assert source is not None
                with open(destination, "wb") as out:
                    while chunk := source.read(CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                if digest.hexdigest() != expected:
                    raise CacheError(f"{archive} is damaged: {relative} does not match its checksum; export it again")
                destination.chmod(member.mode & 0o777)  # compiled .so files keep their exec bit
                seen.add(relative)
            counted.drain()
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # writing, not reading, failed
            raise CacheError(f"{staging.parent} ran out of space importing {archive} ({exc.strerror}); free space "
                             "or import elsewhere") from None
        raise CacheError(f"{archive} is damaged ({exc}); export it again") from None
    except (tarfile.TarError, EOFError, ValueError) as exc:
        raise CacheError(f"{archive} is damaged ({exc}); export it again") from None
    return seen
