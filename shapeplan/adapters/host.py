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


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def process_count(name: str, value: str | int, *, cap: int, what: str) -> int:
    """A count of processes to fork (`value` of the setting `name`) as a whole number from 1 to `cap`, what this
    host has (`what` says so): anything else is refused before a process forks."""
    from ..errors import UsageError

    try:
        count = int(str(value).strip())
    except ValueError:
        count = 0
    if not 1 <= count <= cap:
        raise UsageError(f"{name} must be a whole number of processes from 1 to {cap} ({what}), got {value!r}; "
                         f"set it within that range or leave it unset")
    return count


def workers_setting() -> int | None:
    """$SHAPEPLAN_WORKERS, the tokenizing processes `analyze` forks, checked against the host's cores; None unset."""
    value = os.environ.get("SHAPEPLAN_WORKERS")
    if value is None:
        return None
    return process_count("SHAPEPLAN_WORKERS", value, cap=usable_cores(), what="this host's cores")


def max_forks() -> int:
    """The most processes a run's own setting (TRL's dataset_num_proc) may fork here: a few per core."""
    return 4 * usable_cores()


_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
_hub_state: list[str | None] = []  # the one answer of `hub_offline`, once asked


def hub_offline() -> str | None:
    """Why the Hub cannot be used (offline mode is on, or its host does not answer), None when it can. An
    unreachable Hub turns offline mode on for the libraries, so that they answer from their caches at once instead
    of retrying for a minute. Asked once per process, before the libraries download anything."""
    if not _hub_state:
        _hub_state.append(_probe_hub())
    return _hub_state[0]


# how long the probe waits for the Hub's HTTP answer before planning goes on offline
HUB_PROBE_SECONDS = 3.0


def _probe_hub() -> str | None:
    import http.client
    import sys
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    from ..errors import UsageError

    for name in _OFFLINE_VARIABLES:
        if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"offline mode is on ({name}={os.environ[name]})"
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None  # the Hub is reached through the proxy: a direct connection says nothing
    given = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    endpoint = urlsplit(given)
    host = endpoint.hostname or "huggingface.co"
    try:
        endpoint.port  # noqa: B018  # parsing it is the check
    except ValueError as exc:
        raise UsageError(f"HF_ENDPOINT={given!r} has a port that is not a number; fix HF_ENDPOINT or unset it") \
            from exc
    # an HTTP answer, any status, within the bound: a listener that accepts and never answers (which a connect
    # alone takes for the Hub) would hold every download for minutes of retries
    request = urllib.request.Request(f"{endpoint.scheme or 'https'}://{endpoint.netloc or host}/", method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=HUB_PROBE_SECONDS).close()
        return None
    except urllib.error.HTTPError:
        return None
    except (OSError, http.client.HTTPException, ValueError):
        pass
    for name in _OFFLINE_VARIABLES:
        os.environ[name] = "1"
    for module, attribute in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                              ("datasets.config", "HF_DATASETS_OFFLINE")):  # read at import, if imported already
        if hasattr(sys.modules.get(module), attribute):
            setattr(sys.modules[module], attribute, True)
    return f"the Hub ({host}) cannot be reached from this machine"


def hub_unusable(name: str, kind: str) -> str | None:
    """The one line for a Hub id `name` (a `kind`: "dataset" or "model") that failed to load while the Hub cannot be
    used, or None when the Hub can be used (the failure is then the id's own)."""
    reason = hub_offline()
    if reason is None:
        return None
    repo_type = " --repo-type dataset" if kind == "dataset" else ""
    return (f"{kind} {name} is a Hub id, {reason}, and it is not in the local cache; download it where the Hub is "
            f"reachable (`hf download {name}{repo_type} --local-dir DIR`) and pass DIR (a local "
            f"{'file or folder' if kind == 'dataset' else 'folder'}) instead")
