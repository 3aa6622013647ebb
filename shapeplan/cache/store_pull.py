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
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CacheError, CacheMismatchError
from ..warm.manifest import MANIFEST, Manifest, machine_environment, mismatches
from .contents import PULL_JOURNAL, PULL_STAGING, locked_dir, refuse_incomplete_import, sha256_of
from .limits import DEFAULT_LIMITS, Limits
from .store import OBJECTS, Store, StoreFile, StoreManifest, manifests_of, open_store, store_errors


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
    for manifest in chosen:  # the newest push's copy of a path wins
        wanted.update(manifest.files)
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
            missing = {path: f for path, f in wanted.items() if not (target / path).exists()}
            objects = {f.sha256: f for f in missing.values()}
            size = sum(f.size for f in objects.values())
            if len(missing) > limits.max_files or size > limits.max_bytes:
                raise CacheError(f"the pull would write {len(missing)} files, {size} bytes, over the limits; raise "
                                 "--max-gib / --max-files if it is genuine")
            free = shutil.disk_usage(target).free
            if size > free:
                raise CacheError(f"{target} has {free} bytes free, the pull needs {size}; free space or pull "
                                 "elsewhere")
            added = _pull_locked(store, target, missing, objects, sections) if missing or sections else 0
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


def _pull_locked(store: Store, target: Path, missing: dict[str, StoreFile], objects: dict[str, StoreFile],
                 sections: dict[str, dict[str, Any]]) -> int:
    staging = Path(tempfile.mkdtemp(prefix=f"{PULL_STAGING}{os.getpid()}-", dir=target))
    journaled = False
    try:
        if objects:
            with store_errors(store.url):
                store.fs.get([store.path(OBJECTS, digest) for digest in objects],
                             [str(staging / digest) for digest in objects])
        for digest in objects:
            staged = staging / digest
            if not staged.is_file() or sha256_of(staged) != digest:
                raise CacheError(f"{store.url}: object {OBJECTS}/{digest} does not match its checksum (tampered or "
                                 "damaged); nothing was pulled: delete it from the store and push again")
        journal = {"links": sorted([f.sha256, path, f.mode] for path, f in missing.items()), "sections": sections}
        (staging / PULL_JOURNAL).write_text(json.dumps(journal), encoding="utf-8")
        journaled = True
        return _move_in(staging, target)
    finally:
        if not journaled:
            shutil.rmtree(staging, ignore_errors=True)


def _move_in(staging: Path, target: Path) -> int:
    """Carry out a staging folder's journal: link every staged file to its paths (a path the cache holds is kept),
    record the shapes, remove the staging folder. Repeatable: a pull killed here is finished by the next one."""
    journal = json.loads((staging / PULL_JOURNAL).read_text(encoding="utf-8"))
    for digest, path, mode in journal["links"]:
        destination = target / path
        if destination.exists():
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
    added = Manifest(target / MANIFEST).add_sections(journal["sections"])
    shutil.rmtree(staging)
    return added


def _finish_killed_pulls(target: Path) -> None:
    """Under the pull lock: finish what killed pulls journaled, and remove what they only staged."""
    for staging in sorted(target.glob(f"{PULL_STAGING}*")):
        if (staging / PULL_JOURNAL).is_file():
            _move_in(staging, target)
        else:
            shutil.rmtree(staging, ignore_errors=True)


