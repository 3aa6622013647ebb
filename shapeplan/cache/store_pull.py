"""`cache pull`: download into a cache dir what it lacks of a store's pushes (cache/store.py) of this machine's
environment, all or nothing.

A pull checks the environment (exit 3), the manifests' structure, paths and the limits before downloading;
downloads into a staging folder inside the cache dir, checks every file's sha256 there, then writes a journal and
moves the files in (hard links: a file already in the cache is kept), then records the pulled shapes in the cache
dir's manifest. A pull killed before the journal leaves the cache as it was (the next pull clears its staging);
one killed after it is finished by the next pull, and `warm`, `verify` and `export` refuse the dir until then.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CacheError, CacheMismatchError
from ..warm.manifest import MANIFEST, Manifest, machine_environment, manifest_well_formed, mismatches
from .contents import CHUNK, PULL_JOURNAL, PULL_STAGING, locked_dir, refuse_incomplete_import
from .limits import DEFAULT_LIMITS, Limits
from .store import (
    OBJECTS,
    SHA256,
    Store,
    StoreFile,
    StoreManifest,
    manifests_of,
    open_store,
    path_conflicts,
    refuse_overlap,
    regular_object,
    safe_cache_path,
    store_errors,
)


@dataclass(frozen=True, slots=True)
class PullResult:
    url: str
    cache_dir: str
    manifests: int  # manifests read
    used: int  # manifests of this environment (and plan) pulled
    files: int  # files those manifests name
    present: int  # of which the cache already held
    downloaded: int  # objects downloaded
    downloaded_bytes: int
    shapes: int  # warmed shapes newly recorded in the cache dir's manifest

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "cache_dir": self.cache_dir, "manifests": self.manifests, "used": self.used,
                "files": self.files, "present": self.present, "downloaded_objects": self.downloaded,
                "downloaded_bytes": self.downloaded_bytes, "shapes": self.shapes}


def matching(manifests: list[StoreManifest], here: dict[str, Any], url: str) -> list[StoreManifest]:
    """The manifests compiled in the environment `here`; CacheMismatchError naming the differences of the newest
    when the store holds some, none of them of this environment."""
    found = [m for m in manifests if not mismatches(m.environment, here)]
    if manifests and not found:
        differences = mismatches(manifests[-1].environment, here)
        raise CacheMismatchError(f"{url} holds no cache compiled for this environment: {'; '.join(differences)}; "
                                 "warm this machine's own cache with `shapeplan warm` (and push it)",
                                 differences=differences)
    return found


def select(manifests: list[StoreManifest], tasks: set[str] | None) -> list[StoreManifest]:
    """The manifests a pull needs: all, or with `tasks` (a plan's task keys) those holding one of them warmed."""
    return manifests if tasks is None else [m for m in manifests if m.warmed() & tasks]


def pull(url: str, cache_dir: Path, *, device: str | None = None, tasks: set[str] | None = None,
         limits: Limits = DEFAULT_LIMITS, allow_empty: bool = False) -> PullResult:
    """Download into `cache_dir` what it lacks of the store's manifests of this machine's environment (with
    `tasks`, of those holding one of the plan's shapes), all or nothing. `allow_empty`: a store with nothing for
    this machine pulls nothing instead of refusing (`warm --pull` then warms everything)."""
    store = open_store(url)
    refuse_overlap(store, cache_dir)
    with store_errors(url):
        manifests = manifests_of(store, limits)
    if not manifests and not allow_empty:
        raise CacheError(f"{url} holds no pushed cache; push one with `shapeplan cache push --cache-dir DIR {url}`")
    here = machine_environment(device or (manifests[-1].environment["compiler"].get("device", "cpu")
                                          if manifests else "cpu"))
    try:
        chosen = select(matching(manifests, here, url), tasks)
    except CacheMismatchError:
        if not allow_empty:
            raise
        chosen = []
    wanted: dict[str, StoreFile] = {}
    named_by: dict[str, str] = {}  # checksum -> the push naming it, for a refusal
    for manifest in chosen:  # the newest push's copy of a path wins
        wanted.update(manifest.files)
        named_by.update({f.sha256: manifest.name for f in manifest.files.values()})
    for folder, path in path_conflicts(sorted(wanted))[:1]:
        raise CacheError(f"{url}: the pushes name both {folder!r} and {path!r} (a file and a folder of one name); "
                         "delete the damaged manifest from the store and push again")
    sections: dict[str, dict[str, Any]] = {}
    for manifest in chosen:
        for key, section in manifest.shapes.items():
            merged = sections.setdefault(key, {"environment": section["environment"], "shapes": {}})
            merged["shapes"].update(section["shapes"])
    target = cache_dir.resolve()
    if target.exists() and not target.is_dir():
        raise CacheError(f"{target} is not a folder; pull into a folder (new or a cache dir) with --cache-dir")
    created = not target.exists()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheError(f"cannot create {target} ({exc.strerror}); pull into a writable --cache-dir") from None
    try:
        with locked_dir(target, "`shapeplan cache pull` or `cache import`"):
            _finish_killed_pulls(target)
            refuse_incomplete_import(target)
            missing = {path: f for path, f in wanted.items() if not os.path.lexists(target / path)}
            _refuse_blocked(target, missing)
            objects = {f.sha256: f for f in missing.values()}
            size = sum(f.size for f in objects.values())
            if len(missing) > limits.max_files or size > limits.max_bytes:
                raise CacheError(f"the pull would write {len(missing)} files, {size} bytes, over the limits; raise "
                                 "--max-gib / --max-files if it is genuine")
            free = shutil.disk_usage(target).free
            if size > free:
                raise CacheError(f"{target} has {free} bytes free, the pull needs {size}; free space or pull "
                                 "elsewhere")
            added = _pull_locked(store, target, missing, objects, sections, named_by) \
                if missing or sections else 0
    except BaseException as exc:
        if created:
            with contextlib.suppress(OSError):  # not empty: a racing pull took it over
                target.rmdir()
        if isinstance(exc, PermissionError):
            raise CacheError(f"cannot write into {target} ({exc.strerror}); pull into a writable --cache-dir") \
                from None
        raise
    return PullResult(url, str(target), len(manifests), len(chosen), len(wanted), len(wanted) - len(missing),
                      len(objects), size, added)


def _refuse_blocked(target: Path, missing: dict[str, StoreFile]) -> None:
    """Every folder a pulled file goes into must be a folder (or absent): checked before anything is downloaded, so
    that moving in cannot fail half-way on a file of the cache dir in the way."""
    folders = {"/".join(path.split("/")[:i]) for path in missing for i in range(1, path.count("/") + 1)}
    for folder in sorted(folders):
        place = target / folder
        if os.path.lexists(place) and (place.is_symlink() or not place.is_dir()):
            raise CacheError(f"{place} is in the way of the files the pull writes under it (not a folder); move it "
                             "away, or pull into another --cache-dir")


def _pull_locked(store: Store, target: Path, missing: dict[str, StoreFile], objects: dict[str, StoreFile],
                 sections: dict[str, dict[str, Any]], named_by: dict[str, str]) -> int:
    staging = Path(tempfile.mkdtemp(prefix=f"{PULL_STAGING}{os.getpid()}-", dir=target))
    journaled = False
    try:
        _download(store, staging, objects, named_by)
        journal = {"links": sorted([f.sha256, path, f.mode] for path, f in missing.items()), "sections": sections}
        fd, tmp = tempfile.mkstemp(prefix=f".{PULL_JOURNAL}.", suffix=".tmp", dir=staging)
        with os.fdopen(fd, "w", encoding="utf-8") as out:  # whole or absent: a killed write leaves no journal
            json.dump(journal, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, staging / PULL_JOURNAL)
        journaled = True
        return _move_in(staging, target)
    finally:
        if not journaled:
            shutil.rmtree(staging, ignore_errors=True)


def _download(store: Store, staging: Path, objects: dict[str, StoreFile], named_by: dict[str, str]) -> None:
    """Each object into `staging`, its size and sha256 checked as its bytes arrive: one that runs past the size its
    manifest states stops there (the limits and the free-space check were made of those sizes)."""
    if not objects:
        return
    from concurrent.futures import ThreadPoolExecutor

    def one(item: tuple[str, StoreFile]) -> None:
        digest, entry = item
        source = store.path(OBJECTS, digest)
        bad = CacheError(f"{store.url}: object {OBJECTS}/{digest} does not match its checksum or its size (tampered "
                         "or damaged); nothing was pulled: delete it from the store and push again")
        with store_errors(store.url):
            try:
                if store.local:
                    regular_object(store, source, {}, f"object {OBJECTS}/{digest}")
                handle = store.fs.open(source, "rb")
            except FileNotFoundError:
                raise CacheError(f"{store.url}: object {OBJECTS}/{digest}, named by push {named_by.get(digest)}, is "
                                 "missing from the store; nothing was pulled: push again from a cache dir that holds "
                                 "it, or delete that manifest") from None
            checksum, size = hashlib.sha256(), 0
            with handle, open(staging / digest, "xb") as out:
                while chunk := handle.read(min(CHUNK, entry.size + 1 - size)):
                    size += len(chunk)
                    if size > entry.size:
                        raise bad
                    checksum.update(chunk)
                    out.write(chunk)
        if size != entry.size or checksum.hexdigest() != digest:
            raise bad

    workers = 1 if store.local else 8  # S3: requests in flight at once, as `fs.get` had
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in pool.map(one, sorted(objects.items())):
            pass


def _journal(staging: Path) -> tuple[list[tuple[str, str, int]], dict[str, Any]] | None:
    """A staging folder's journal, checked as nothing from disk is trusted: its links (checksum, path, mode) and
    sections, or None when it is unreadable, damaged, names a path a pull may not write or a staged file that is
    gone (a pull killed then cannot be finished: the staging is discarded and the next pull starts over)."""
    try:
        journal = json.loads((staging / PULL_JOURNAL).read_bytes().decode("utf-8"))
        links, sections = journal["links"], journal["sections"]
        if not (isinstance(links, list) and isinstance(sections, dict)
                and manifest_well_formed({"environments": sections})):
            return None
        checked = []
        for link in links:
            digest, path, mode = link
            if not (isinstance(digest, str) and SHA256.fullmatch(digest) and isinstance(path, str)
                    and safe_cache_path(path) and type(mode) is int):
                return None
            checked.append((digest, path, mode & 0o777))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return checked, sections


def _move_in(staging: Path, target: Path) -> int:
    """Carry out a staging folder's journal: link every staged file to its paths (a path the cache holds is kept),
    record the shapes, remove the staging folder. Repeatable: a pull killed here is finished by the next one; one
    whose journal cannot be carried out is discarded (0 shapes added) and the pull starts over."""
    journal = _journal(staging)
    links, sections = journal if journal is not None else ([], {})
    if journal is None or any(not (staging / digest).is_file() for digest, path, _ in links
                            if not os.path.lexists(target / path)):
        shutil.rmtree(staging, ignore_errors=True)
        return 0
    try:
        _refuse_blocked(target, {path: StoreFile(digest, 0, mode) for digest, path, mode in links})
    except CacheError:
        shutil.rmtree(staging, ignore_errors=True)
        return 0
    for digest, path, mode in links:
        destination = target / path
        if os.path.lexists(destination):
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        staged = staging / digest
        staged.chmod(mode)
        try:
            os.link(staged, destination)
        except FileExistsError:
            continue
        except OSError:  # a file system without hard links: copy, renamed into place
            fd, tmp = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".tmp", dir=destination.parent)
            os.close(fd)
            shutil.copy2(staged, tmp)
            os.replace(tmp, destination)
    added = Manifest(target / MANIFEST).add_sections(sections)
    shutil.rmtree(staging)
    return added


def _finish_killed_pulls(target: Path) -> None:
    """Under the pull lock: finish what killed pulls journaled, and remove what they only staged."""
    for staging in sorted(target.glob(f"{PULL_STAGING}*")):
        if staging.is_symlink() or not staging.is_dir():
            staging.unlink(missing_ok=True)
        elif (staging / PULL_JOURNAL).is_file():
            _move_in(staging, target)
        else:
            shutil.rmtree(staging, ignore_errors=True)


