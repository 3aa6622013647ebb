"""The manifest: the cache dir's record of warmed shapes, per environment.

A shape enters `shapeplan-manifest.json`, atomically and under a lock, only after its step finished, so a run
killed mid-shape leaves the manifest as it was and the next run redoes that shape (the compile caches write their
own entries atomically too). Its environment key is the hash of everything besides the shapes that decides what is
compiled: versions, compiler settings, world size, dtype, model and config.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..errors import CacheError, CacheMismatchError, UsageError
from ..host import installed_versions
from ..plan.io import write_atomic
from .model import ManifestEntry, Task

MANIFEST = "shapeplan-manifest.json"
MANIFEST_SCHEMA = 1


def environment_key(environment: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(environment, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _manifest_well_formed(data: dict[str, Any]) -> bool:
    """{"environments": {key: {"environment": {...}, "shapes": {task: {"status": str, ...}}}}}"""
    environments = data.get("environments")
    if not isinstance(environments, dict):
        return False
    for section in environments.values():
        if not (isinstance(section, dict) and isinstance(section.get("environment"), dict)
                and isinstance(section.get("shapes"), dict)):
            return False
        if not all(isinstance(e, dict) and isinstance(e.get("status"), str) for e in section["shapes"].values()):
            return False
    return True


class Manifest:
    """The cache dir's record of warmed shapes, per environment."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = self._read()

    def _read(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {"schema": MANIFEST_SCHEMA, "environments": {}}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise CacheError(f"manifest {self.path} is unreadable ({exc.strerror}); delete it to re-warm this cache "
                             "dir") from exc
        except ValueError as exc:  # bad JSON, or bytes that are not UTF-8
            raise CacheError(f"manifest {self.path} is not UTF-8 JSON ({exc}); delete it to re-warm this cache dir") \
                from exc
        if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
            raise CacheError(f"manifest {self.path} has an unknown schema; delete it to re-warm this cache dir")
        if not _manifest_well_formed(data):
            raise CacheError(f"manifest {self.path} does not have a manifest's structure; delete it to re-warm this "
                             "cache dir")
        return data

    def done(self, environment: str, task: Task) -> bool:
        entry = self.data["environments"].get(environment, {}).get("shapes", {}).get(task.key)
        return entry is not None and entry.get("status") in ("compiled", "cached")

    def record(self, entry: ManifestEntry, environment: dict[str, Any]) -> None:
        """Add `entry` under a lock, to the manifest as it is on disk: other processes (workers, ranks) record
        into the same manifest."""
        from .parallel import locked

        try:
            with locked(self.path):
                self.data = self._read()
                section = self.data["environments"].setdefault(entry.environment,
                                                               {"environment": environment, "shapes": {}})
                section["shapes"][entry.task] = entry.to_dict()
                write_atomic(self.path, json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        except OSError as exc:
            raise CacheError(f"cannot write manifest {self.path}: {exc.strerror}; pass a writable --cache-dir") \
                from exc


# The packages whose versions a cache archive records and an import checks against this machine.
MACHINE_PACKAGES = ("torch", "trl", "transformers", "accelerate")


def machine_environment(device: str) -> dict[str, Any]:
    """This machine's versions and compiler settings, as the warm-up records them."""
    from .backends import make_backend

    try:
        compiler = make_backend(device).settings()
    except UsageError as exc:  # e.g. a neuron cache on a machine without torch-neuronx
        raise CacheMismatchError(f"this machine cannot use a {device} cache: {exc}") from None
    versions = {name: version or "none" for name, version in installed_versions(MACHINE_PACKAGES).items()}
    return {"versions": versions, "compiler": compiler}
