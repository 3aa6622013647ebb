"""What this machine has: the installed package versions (as plans, caches and manifests record them) and the
root of shapeplan's caches."""

from __future__ import annotations

import os
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path


def cache_root() -> Path:
    """$SHAPEPLAN_CACHE_DIR, or ~/.cache/shapeplan: a persistent folder (not /tmp, which boots may clear)."""
    return Path(os.environ.get("SHAPEPLAN_CACHE_DIR") or Path.home() / ".cache" / "shapeplan")


def installed_versions(names: Iterable[str]) -> dict[str, str | None]:
    """name -> installed version, None where the package is not installed."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def installed_only(names: Iterable[str]) -> dict[str, str]:
    """name -> version of the packages of `names` that are installed."""
    return {name: version for name, version in installed_versions(names).items() if version is not None}
