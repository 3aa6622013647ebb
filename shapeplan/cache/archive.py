"""Portable compile caches, for baking into machine images: a warmed cache dir with its manifest, a checksum per
file and the environment its code was compiled in, as one .tar.gz.

The archive holds `shapeplan-archive.json` first (schema, environment, sha256 of every file), then the cache dir's
files under `cache/`. Importing checks the environment against this machine's before extracting anything, extracts
into a temporary folder next to the target, checks every file against its checksum, and only then renames the
folder into place: an import either leaves a complete cache or nothing.
"""

from __future__ import annotations

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
from ..host import installed_versions
from ..warm.runner import MANIFEST

ARCHIVE_META = "shapeplan-archive.json"
ARCHIVE_SCHEMA = 1
PREFIX = "cache"
PACKAGES = ("torch", "trl", "transformers", "accelerate")
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class ArchiveInfo:
    path: str
    environment: dict[str, Any]  # {"versions": {...}, "compiler": backend settings}
    files: dict[str, str]  # path under the cache dir -> sha256
    shapes: int  # warmed shapes the manifest records

    def to_dict(self) -> dict[str, Any]:
        return {"archive": self.path, "environment": self.environment, "files": len(self.files),
                "shapes": self.shapes}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _cache_files(cache_dir: Path) -> Iterator[Path]:
    """The cache's files, sorted; lock files and in-progress temporaries are left out."""
    for path in sorted(cache_dir.rglob("*")):
        if path.is_symlink():
            raise CacheError(f"{path} is a symbolic link; a cache to export must hold only files and folders")
        name = path.name
        if path.is_file() and not (name.endswith(".lock") or name.startswith(".shapeplan-probe-")
                                   or (name.startswith(".") and name.endswith(".tmp"))):
            yield path


def cache_environment(cache_dir: Path) -> tuple[dict[str, Any], int]:
    """The one environment (versions, compiler settings) the cache dir's shapes were warmed in, and their count."""
    from ..warm.runner import Manifest

    manifest_path = cache_dir / MANIFEST
    if not manifest_path.is_file():
        raise CacheError(f"{cache_dir} has no {MANIFEST}; warm it with `shapeplan warm --cache-dir {cache_dir}` first")
    sections = Manifest(manifest_path).data["environments"].values()
    found = {json.dumps({"versions": s["environment"].get("versions"), "compiler": s["environment"].get("compiler")},
                        sort_keys=True) for s in sections}
    if len(found) != 1:
        raise CacheError(f"{cache_dir} holds shapes warmed with {len(found)} different package versions or compiler "
                         "settings; export a cache dir warmed in one environment")
    warmed = sum(1 for s in sections for entry in s["shapes"].values() if entry["status"] in ("compiled", "cached"))
    return json.loads(found.pop()), warmed


def export_cache(cache_dir: Path, archive: Path) -> ArchiveInfo:
    """Write `cache_dir` (a warmed cache) to `archive` atomically."""
    cache_dir = cache_dir.resolve()
    environment, shapes = cache_environment(cache_dir)
    files = {path.relative_to(cache_dir).as_posix(): _sha256(path) for path in _cache_files(cache_dir)}
    meta = json.dumps({"schema": ARCHIVE_SCHEMA, "environment": environment, "files": files}, indent=2,
                      sort_keys=True).encode()
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{archive.name}.", suffix=".tmp", dir=archive.parent)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            entry = tarfile.TarInfo(ARCHIVE_META)
            entry.size = len(meta)
            entry.mode = 0o644
            tar.addfile(entry, io.BytesIO(meta))
            for name in files:
                tar.add(cache_dir / name, arcname=f"{PREFIX}/{name}", recursive=False)
        os.replace(tmp, archive)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise CacheError(f"cannot write {archive}: {exc.strerror}; choose a writable path with -o") from exc
    return ArchiveInfo(str(archive), environment, files, shapes)


def _open(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, mode="r:gz")
    except FileNotFoundError:
        raise CacheError(f"archive {archive} does not exist; pass a file written by `shapeplan cache export`") \
            from None
    except (OSError, tarfile.TarError) as exc:
        raise CacheError(f"{archive} is not a shapeplan cache archive ({exc}); pass a file written by "
                         "`shapeplan cache export`") from None


def read_info(archive: Path) -> ArchiveInfo:
    """The archive's environment and file list (its first member), without extracting anything."""
    with _open(archive) as tar:
        first = tar.next()
        handle = tar.extractfile(first) if first is not None and first.name == ARCHIVE_META else None
        try:
            meta = json.loads(handle.read()) if handle is not None else None
        except (ValueError, tarfile.TarError, OSError):
            meta = None
    if not isinstance(meta, dict) or meta.get("schema") != ARCHIVE_SCHEMA or not isinstance(meta.get("files"), dict):
        raise CacheError(f"{archive} is not a shapeplan cache archive (no readable {ARCHIVE_META}); pass a file "
                         "written by `shapeplan cache export`")
    return ArchiveInfo(str(archive), meta["environment"], meta["files"], shapes=0)


def machine_environment(device: str) -> dict[str, Any]:
    """This machine's versions and compiler settings, as the warm-up records them."""
    from ..errors import UsageError
    from ..warm.backends import make_backend

    try:
        compiler = make_backend(device).settings()
    except UsageError as exc:  # e.g. a neuron cache on a machine without torch-neuronx
        raise CacheMismatchError(f"this machine cannot use a {device} cache: {exc}") from None
    versions = {name: version or "none" for name, version in installed_versions(PACKAGES).items()}
    return {"versions": versions, "compiler": compiler}


def mismatches(archived: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """'name: archived (this machine: value)' for every version or setting that differs."""
    out = []
    for group in ("versions", "compiler"):
        a, b = archived.get(group) or {}, here.get(group) or {}
        for name in sorted(set(a) | set(b)):
            if a.get(name) != b.get(name):
                out.append(f"{name}={a.get(name, '<unset>')!s} (this machine: {b.get(name, '<unset>')!s})")
    return out


def _member_path(member: tarfile.TarInfo, archive: Path) -> str | None:
    """The cache-relative path of a file member; None for the metadata and folders; refuses anything that would
    land outside the cache (absolute paths, '..') and links or special files."""
    if member.name == ARCHIVE_META:
        return None
    name = PurePosixPath(member.name)
    if name.is_absolute() or ".." in name.parts or name.parts[:1] != (PREFIX,):
        raise CacheError(f"{archive} has a member outside the cache ({member.name}); refusing it")
    if member.isdir():
        return None
    if not member.isfile() or len(name.parts) < 2:
        raise CacheError(f"{archive} has a link or special file ({member.name}); refusing it")
    return PurePosixPath(*name.parts[1:]).as_posix()


def import_cache(archive: Path, cache_dir: Path, *, device: str | None = None) -> ArchiveInfo:
    """Extract `archive` into the empty or new `cache_dir` after checking that it matches this machine."""
    info = read_info(archive)
    here = machine_environment(device or info.environment.get("compiler", {}).get("device", "cpu"))
    differences = mismatches(info.environment, here)
    if differences:
        raise CacheMismatchError(f"{archive} was compiled for another environment: {'; '.join(differences)}; "
                                 "warm this machine's own cache with `shapeplan warm` instead")
    target = cache_dir.resolve()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CacheError(f"{target} is not an empty folder; import into a new or empty --cache-dir")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.importing-", dir=target.parent))
    try:
        seen = _extract(archive, info, staging)
        missing = sorted(set(info.files) - seen)
        if missing:
            raise CacheError(f"{archive} is damaged: {missing[0]} is listed but missing; export it again")
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is read by whoever trains
        if target.exists():
            target.rmdir()
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ArchiveInfo(info.path, info.environment, info.files, cache_environment(target)[1])


def _extract(archive: Path, info: ArchiveInfo, staging: Path) -> set[str]:
    seen: set[str] = set()
    with _open(archive) as tar:
        try:
            for member in tar:
                relative = _member_path(member, archive)
                if relative is None:
                    continue
                expected = info.files.get(relative)
                if expected is None or relative in seen:
                    raise CacheError(f"{archive} is damaged: {relative} is not in its checksum list; export it again")
                destination = staging / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()
                source = tar.extractfile(member)
                assert source is not None
                with open(destination, "wb") as out:
                    while chunk := source.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                if digest.hexdigest() != expected:
                    raise CacheError(f"{archive} is damaged: {relative} does not match its checksum; export it again")
                seen.add(relative)
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            raise CacheError(f"{archive} is damaged ({exc}); export it again") from None
    return seen
