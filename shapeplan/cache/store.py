"""A shared compile-cache store at any fsspec URL (`s3://bucket/prefix`, a folder, `file://...`): `cache push`
uploads what the store lacks; `cache ls` and `warm --status URL` read its manifests.

Layout under the URL (S3 has no rename, so nothing is ever rewritten):

    objects/<sha256>                                 a cache file's content, under its checksum, written once
    manifests/<environment key>/<time>-<host>-<pid>-<random>.json
                                                     one per push, written once, after its objects: the
                                                     environment (versions, compiler settings), the files the
                                                     pushed cache dir holds (path -> sha256, size, mode) and the
                                                     shapes its manifests record as warmed

Readers merge every manifest, as `warm` merges its shards' manifest files on disk, so concurrent pushes (fleet
shards) lose nothing; a killed push leaves objects no manifest names yet, which the next push reuses.

`cache pull` (cache/store_pull.py) downloads what a cache dir lacks, with the checks `cache import` makes.
Credentials and endpoints are fsspec's and the filesystem's own (s3fs: AWS_PROFILE, AWS_ENDPOINT_URL, ...).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CacheError, UsageError, first_line
from ..warm.manifest import (
    WARMED,
    MergedManifest,
    environment_key,
    manifest_well_formed,
    read_merged,
)
from .contents import (
    IMPORT_MARKER,
    PULL_STAGING,
    STAGING_PREFIX,
    cache_environment,
    cache_files,
    check_times,
    is_temporary,
    is_unix_time,
    refuse_incomplete_import,
    sha256_of,
)
from .limits import DEFAULT_LIMITS, Limits

STORE_SCHEMA = 1
OBJECTS = "objects"
MANIFESTS = "manifests"
SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class StoreFile:
    sha256: str
    size: int
    mode: int  # permission bits: compiled .so files keep their exec bit


@dataclass(frozen=True, slots=True)
class StoreManifest:
    """One push: where it came from, the environment it was compiled in, its files and warmed shapes."""

    name: str  # under manifests/
    environment: dict[str, Any]  # {"versions": {...}, "compiler": {...}}
    files: dict[str, StoreFile]  # path under the cache dir -> content
    shapes: dict[str, dict[str, Any]]  # the pushed manifests' sections: {key: {"environment", "shapes"}}
    pushed_at: float
    host: str

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def warmed(self) -> set[str]:
        """The task keys this push holds warmed, in any of its sections."""
        return {task for section in self.shapes.values() for task, entry in section["shapes"].items()
                if entry["status"] in WARMED}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "environment": self.environment, "pushed_at": self.pushed_at, "host": self.host,
                "files": len(self.files), "bytes": self.bytes, "shapes": len(self.warmed())}


@dataclass(frozen=True, slots=True)
class PushResult:
    url: str
    manifest: str  # the manifest written
    files: int  # the cache dir's files
    shapes: int  # warmed shapes pushed
    uploaded: int  # objects the store lacked
    uploaded_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "manifest": self.manifest, "files": self.files, "shapes": self.shapes,
                "uploaded_objects": self.uploaded, "uploaded_bytes": self.uploaded_bytes}


@dataclass(frozen=True, slots=True)
class Store:
    """An opened store: its fsspec filesystem and root path in it."""

    url: str
    fs: Any  # fsspec.AbstractFileSystem
    root: str

    @property
    def local(self) -> bool:
        return "file" in _protocols(self.fs)

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


@contextlib.contextmanager
def store_errors(url: str) -> Iterator[None]:
    """What the filesystem (s3fs, botocore, the OS) raises, as one line naming the fix."""
    try:
        yield
    except (CacheError, UsageError):
        raise
    except FileNotFoundError as exc:
        raise CacheError(f"{url}: {exc.args[-1] if exc.args else exc} (no such bucket or folder); create it (e.g. "
                         "`aws s3 mb s3://BUCKET`) or check the URL") from None
    except PermissionError as exc:
        raise CacheError(f"{url}: access denied ({exc}); check the credentials and the bucket policy "
                         "(AWS_PROFILE, AWS_ACCESS_KEY_ID, the instance role)") from None
    except Exception as exc:
        if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            raise CacheError(f"{url}: no credentials found ({exc}); set AWS_PROFILE or AWS_ACCESS_KEY_ID/"
                             "AWS_SECRET_ACCESS_KEY, or run on an instance with a role") from None
        if "Timeout" in type(exc).__name__ and type(exc).__module__.split(".")[0] in ("botocore", "aiobotocore"):
            raise CacheError(f"{url}: no answer within {_timeout():g} s on any of {STORE_ATTEMPTS} tries "
                             f"({type(exc).__name__}); check the endpoint (AWS_ENDPOINT_URL) and the network, or "
                             "raise SHAPEPLAN_STORE_TIMEOUT for a slow one") from None
        if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp"):
            raise CacheError(f"{url}: {first_line(exc, named=True)}; check the URL, the endpoint (AWS_ENDPOINT_URL) "
                             "and the network") from None
        raise


# The protocols a store may use: a shared, persistent, writable filesystem (a process-local `memory://` store, a
# read-only `http://` one or a chained `zip::...` URL would exit 0 for a push nobody can read back).
_LOCAL_PROTOCOLS = ("file", "local")
_S3_PROTOCOLS = ("s3", "s3a")
_PROTOCOLS = (*_LOCAL_PROTOCOLS, *_S3_PROTOCOLS, "gs", "gcs", "az", "abfs", "abfss")
# Seconds an S3 request may wait to connect or for the next bytes (SHAPEPLAN_STORE_TIMEOUT overrides), and the times
# it is sent: an endpoint that accepts and never answers ends in a one-line error after STORE_ATTEMPTS waits (botocore
# retries; s3fs's own retry loop, around botocore's attempts, would multiply them), not a hang.
STORE_TIMEOUT_S = 20.0
STORE_ATTEMPTS = 2


def _protocol_of(url: str) -> str | None:
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", url)
    return match[1].lower() if match else None


def check_store_url(url: str) -> None:
    """UsageError (exit 2) for a URL no store can live at, before anything is opened."""
    if not url.strip():
        raise UsageError("the store URL is empty; pass s3://BUCKET/PREFIX or a folder")
    if "::" in url:
        raise UsageError(f"{url!r} chains filesystems (`::`), which a store does not support; pass "
                         "s3://BUCKET/PREFIX or a folder")
    protocol = _protocol_of(url)
    if protocol == "memory":
        raise UsageError(f"{url}: a memory:// store lives only in this process and is gone when it exits; pass "
                         "s3://BUCKET/PREFIX or a shared folder")
    if protocol is not None and protocol not in _PROTOCOLS:
        raise UsageError(f"{url}: {protocol}:// is not a protocol a store supports ({', '.join(_PROTOCOLS)}); pass "
                         "s3://BUCKET/PREFIX or a folder")
    if protocol in _S3_PROTOCOLS:
        for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            if os.environ.get(name):
                _check_endpoint(name, os.environ[name])


def _check_endpoint(name: str, value: str) -> None:
    from urllib.parse import urlsplit

    bad = UsageError(f"{name}={value!r} is not an endpoint URL; set it to e.g. https://s3.example.com:9000 or unset "
                     "it")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  # raises ValueError on a port out of range or not a number
    except ValueError:
        raise bad from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in value):
        raise bad


def _timeout() -> float:
    text = os.environ.get("SHAPEPLAN_STORE_TIMEOUT", "")
    if not text:
        return STORE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise UsageError(f"SHAPEPLAN_STORE_TIMEOUT={text!r} is not a number of seconds from 0 to 3600; set e.g. 30")
    return value


def open_store(url: str) -> Store:
    """The store at `url`, through fsspec (a plain path is a local folder)."""
    check_store_url(url)
    try:
        import fsspec
    except ImportError:
        raise UsageError("the store needs fsspec; install shapeplan[s3]") from None
    options: dict[str, Any] = {}
    if _protocol_of(url) in _S3_PROTOCOLS:
        timeout = _timeout()
        # total_max_attempts counts the first try (botocore's max_attempts counts only the retries)
        options["config_kwargs"] = {"connect_timeout": timeout, "read_timeout": timeout,
                                    "retries": {"total_max_attempts": STORE_ATTEMPTS, "mode": "standard"}}
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise UsageError(f"{url}: {str(exc).splitlines()[0]}; for s3:// install shapeplan[s3] (s3fs)") from None
    except ValueError as exc:  # an unknown protocol
        raise UsageError(f"{url} is not a URL fsspec can open ({exc}); pass s3://BUCKET/PREFIX or a folder") \
            from None
    if "config_kwargs" in options:
        fs.retries = 1  # s3fs's own loop (5 tries by default) around botocore's attempts: one try, no retry
    return Store(url, fs, root)


def refuse_overlap(store: Store, cache_dir: Path) -> None:
    """A local store may not be the cache dir, nor lie inside it (its objects would become cache files), nor hold
    the cache dir among its own objects or manifests."""
    if not store.local:
        return
    root, cache = Path(os.path.realpath(store.root)), Path(os.path.realpath(cache_dir))
    if root == cache or cache in root.parents:
        raise UsageError(f"the store {store.url} is {'the cache dir' if root == cache else 'inside the cache dir'} "
                         f"{cache}; pass a store folder outside it")
    if any(folder == cache or folder in cache.parents for folder in (root / OBJECTS, root / MANIFESTS)):
        raise UsageError(f"the cache dir {cache} lies inside the store {store.url}'s own files; pass a cache dir "
                         "outside it")


# --- push -------------------------------------------------------------------------------------------------------


def push(cache_dir: Path, url: str) -> PushResult:
    """Upload the warmed `cache_dir`'s files the store lacks, then its manifest (a new object, never rewritten)."""
    check_store_url(url)  # before the cache dir's files are hashed
    cache_dir = cache_dir.resolve()
    refuse_incomplete_import(cache_dir)
    environment, shapes = cache_environment(cache_dir)
    warmed = read_merged(cache_dir).environments
    check_times(warmed, f"the manifest of {cache_dir}", "delete it to re-warm this cache dir")  # before any upload
    sections = {key: {"environment": s["environment"],
                      "shapes": {t: {k: v for k, v in e.items() if k != "shard"} for t, e in s["shapes"].items()}}
                for key, s in warmed.items()}
    # its manifests travel as the push's sections; a name no pull would write (shapeplan's own) stays here
    paths = [p for p in cache_files(cache_dir) if safe_cache_path(p.relative_to(cache_dir).as_posix())]
    files = {p.relative_to(cache_dir).as_posix(): StoreFile(sha256_of(p), p.stat().st_size, p.stat().st_mode & 0o777)
             for p in paths}
    store = open_store(url)
    refuse_overlap(store, cache_dir)
    with store_errors(url):
        held = _objects(store)
        todo: dict[str, Path] = {}
        for path in paths:
            digest = files[path.relative_to(cache_dir).as_posix()].sha256
            if digest not in held:
                todo.setdefault(digest, path)
        _upload(store, [(source, store.path(OBJECTS, digest)) for digest, source in todo.items()])
        name = f"{environment_key(environment)}/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-" \
               f"{_slug(socket.gethostname())}-{os.getpid()}-{uuid.uuid4().hex[:12]}.json"
        body = {"schema": STORE_SCHEMA, "environment": environment, "pushed_at": time.time(),
                "host": socket.gethostname(), "shapes": sections,
                "files": {p: {"sha256": f.sha256, "size": f.size, "mode": f.mode} for p, f in sorted(files.items())}}
        _write_once(store, store.path(MANIFESTS, name), json.dumps(body, indent=1, sort_keys=True).encode())
    return PushResult(url, name, len(files), shapes, len(todo), sum(p.stat().st_size for p in todo.values()))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", text)[:40] or "host"


def _objects(store: Store) -> set[str]:
    """The checksums the store holds (one listing)."""
    store.fs.invalidate_cache()  # s3fs caches listings per process: other hosts push meanwhile
    try:
        names = store.fs.find(store.path(OBJECTS))
    except FileNotFoundError:
        if not store.local:
            raise  # S3: the bucket does not exist
        return set()
    return {name.rsplit("/", 1)[-1] for name in names if SHA256.fullmatch(name.rsplit("/", 1)[-1])}


def _upload(store: Store, pairs: list[tuple[Path, str]]) -> None:
    """Copy local files to new store objects; in a local store through a temporary name, so that an object is
    whole or absent (an S3 PUT is whole by itself)."""
    if not pairs:
        return
    if not store.local:
        store.fs.put([str(source) for source, _ in pairs], [target for _, target in pairs])
        return
    for source, target in pairs:
        _write_local(Path(target), source)


def _write_once(store: Store, target: str, data: bytes) -> None:
    if store.local:
        _write_local(Path(target), data)
    else:
        store.fs.pipe_file(target, data)


def _write_local(target: Path, content: bytes | Path) -> None:
    """`content` (bytes, or a file to copy) as `target`, renamed into place whole."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            if isinstance(content, Path):
                with open(content, "rb") as source:
                    shutil.copyfileobj(source, out)
            else:
                out.write(content)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- reading manifests ------------------------------------------------------------------------------------------


def read_manifests(url: str, limits: Limits = DEFAULT_LIMITS) -> list[StoreManifest]:
    """Every manifest of the store, checked, oldest first."""
    store = open_store(url)
    with store_errors(url):
        return manifests_of(store, limits)


def manifests_of(store: Store, limits: Limits) -> list[StoreManifest]:
    store.fs.invalidate_cache()
    try:
        listing = store.fs.find(store.path(MANIFESTS), detail=True)
    except FileNotFoundError:
        if not store.local:
            raise
        listing = {}
    names = sorted(name for name in listing if name.endswith(".json"))
    if len(names) > limits.max_files:
        raise CacheError(f"{store.url} holds {len(names)} manifests, over the limit of {limits.max_files}; raise "
                         "--max-files if it is genuine")
    prefix = store.path(MANIFESTS) + "/"
    for name in names:
        regular_object(store, name, listing[name], f"manifest {name.removeprefix(prefix)}")
        if int(listing[name].get("size") or 0) > limits.max_metadata:
            raise CacheError(f"{store.url}: manifest {name} is over the {limits.max_metadata}-byte limit; raise "
                             "--max-metadata-mib if it is genuine")
    manifests = [_parse(store.url, name.removeprefix(prefix), _read_bounded(store, name, limits.max_metadata))
                 for name in names]
    return sorted(manifests, key=lambda m: (m.pushed_at, m.name))


def regular_object(store: Store, path: str, info: dict[str, Any], what: str) -> None:
    """Refuse a store entry that is not a regular file (in a local store: a link, a FIFO, a device), before it is
    opened: a link to /dev/zero would be read without end, a FIFO would block forever."""
    if store.local:
        import stat

        mode = os.lstat(path).st_mode
        regular = stat.S_ISREG(mode)
    else:
        regular = info.get("type", "file") == "file"
    if not regular:
        raise CacheError(f"{store.url}: {what} is not a regular file (a link, FIFO or device); delete it from the "
                         "store and push again")


def _read_bounded(store: Store, path: str, limit: int) -> bytes:
    """A manifest's bytes, at most `limit` of them whatever the listing said (it may change under us)."""
    with store.fs.open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise CacheError(f"{store.url}: manifest {path} is over the {limit}-byte limit; raise --max-metadata-mib if "
                         "it is genuine")
    return bytes(data)


def _parse(url: str, name: str, data: bytes) -> StoreManifest:
    bad = CacheError(f"{url}: manifest {name} is not a shapeplan store manifest (damaged or foreign); delete it "
                     "from the store and push again")
    try:
        body = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # RecursionError: nested past what json's parser recurses into
        raise bad from None
    if not isinstance(body, dict) or body.get("schema") != STORE_SCHEMA:
        raise bad
    environment, files, shapes = body.get("environment"), body.get("files"), body.get("shapes")
    if not (isinstance(environment, dict) and all(isinstance(environment.get(k), dict)
                                                  for k in ("versions", "compiler"))
            and isinstance(files, dict) and isinstance(shapes, dict)
            and manifest_well_formed({"environments": shapes})
            and isinstance(body.get("pushed_at"), (int, float)) and isinstance(body.get("host"), str)):
        raise bad
    fix = "delete it from the store and push again"
    if not is_unix_time(body["pushed_at"]):  # `cache ls` shows it as a date
        raise CacheError(f"{url}: manifest {name} records pushed_at {body['pushed_at']!r}, not a Unix time; {fix}")
    check_times(shapes, f"{url}: manifest {name}", fix)
    parsed: dict[str, StoreFile] = {}
    for path, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and SHA256.fullmatch(entry["sha256"])
                and type(entry.get("size")) is int and entry["size"] >= 0 and type(entry.get("mode")) is int):
            raise bad
        _check_path(url, name, path)
        parsed[path] = StoreFile(entry["sha256"], entry["size"], entry["mode"] & 0o777)
    for section in shapes.values():  # the shapes were warmed in the environment the manifest states
        if {k: section["environment"].get(k) for k in ("versions", "compiler")} != \
                {k: environment[k] for k in ("versions", "compiler")}:
            raise CacheError(f"{url}: manifest {name} records shapes of another environment than its own; delete it "
                             "from the store and push again")
    return StoreManifest(name, environment, parsed, shapes, float(body["pushed_at"]), body["host"])


def _check_path(url: str, name: str, path: str) -> None:
    """A path a pull may write: inside the cache dir, no name shapeplan reserves, no manifest or temporary."""
    if not safe_cache_path(path):
        raise CacheError(f"{url}: manifest {name} names a path a pull refuses to write ({path!r}); delete it from "
                         "the store and push again")


def safe_cache_path(path: str) -> bool:
    """Whether a pull (or a pull's journal) may write `path` under a cache dir: relative, below it, no part that is
    one of shapeplan's own names (manifests and their locks, staging folders, markers, probes), a lock or an
    in-flight temporary, no control character, within the file system's name limits."""
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and len(path.encode("utf-8", "replace")) <= 1024 \
        and not any(ord(c) < 0x20 or c == "\x7f" for c in path) \
        and all(p not in ("..", ".", "") and len(p.encode("utf-8", "replace")) <= 255
                and not p.startswith(("shapeplan-manifest", ".shapeplan-", STAGING_PREFIX, PULL_STAGING))
                and p != IMPORT_MARKER and not p.endswith(".lock") and not is_temporary(p) for p in parts)


def path_conflicts(paths: list[str]) -> list[tuple[str, str]]:
    """Pairs of paths of which one would be the other's folder (`a` and `a/b`): no pull could write both."""
    names = set(paths)
    return [(folder, path) for path in paths
            for folder in ("/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1)) if folder in names]


# --- the store as a manifest ------------------------------------------------------------------------------------


def merged(manifests: list[StoreManifest]) -> MergedManifest:
    """The store's manifests as one merged manifest (as `read_merged` gives a cache dir's), each shape's "shard"
    naming the push that holds it, for `plan_status`."""
    environments: dict[str, dict[str, Any]] = {}
    for manifest in manifests:
        for key, section in manifest.shapes.items():
            held = environments.setdefault(key, {"environment": section["environment"], "shapes": {}})
            for task, entry in section["shapes"].items():
                if entry["status"] in WARMED and held["shapes"].get(task, {}).get("status") not in WARMED:
                    held["shapes"][task] = {**entry, "shard": manifest.name}
    return MergedManifest((), environments)

