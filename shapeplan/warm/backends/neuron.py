"""TorchNeuron (torch-neuronx >= 2.13, Trn2/Trn3): NEFFs for eager ops and `torch.compile(backend="neuron")`
graphs go to TORCH_NEURONX_NEFF_CACHE_DIR.

What this module relies on, read from TorchNeuron's source (an April 2026 tree; research/neuron-audit.md):
- `import torch` autoloads torch_neuronx, whose import sets defaults for nine variables (NEURON_LAUNCH_BLOCKING and
  five TORCH_NEURONX_* among them). So the compiler environment is always described after that import
  (`settings`), in every command: a cache warmed here compares equal here.
- Every compile counter (`_C._get_compilation_cache_stats()` and `torch_neuronx.metrics` alike) reads one metrics
  arena that counts only while metrics are enabled: TORCH_NEURONX_METRICS_ENABLED is read at the first counter use,
  `torch_neuronx.metrics.set_enabled` switches it later. `prepare` and `enable_metrics` turn it on.
- Compiles run on the backend's own thread, so every counter read synchronizes first.
- A persistent miss is not a compile: after the miss the compile takes a file lock and reads the disk again, and a
  NEFF another process wrote meanwhile counts as a hit. Only `total_compilations` counts this process's compiles.
  A new NEFF file in a shared cache dir may be another process's (a warm worker, a fleet shard, a data-parallel
  rank), so in async mode files decide nothing; only sync mode's eager compiles, which move no counter, are told by
  files, and then only by that path's own `<sha256>/<sha256>.neff` layout (CompilationCache.cpp:517-566).
- A NEFF file of size 0 is a miss (PersistentCacheBackend.cpp:89-94): it is not counted, exported or pushed.
- NEURON_LAUNCH_BLOCKING=1 (sync mode) sends eager ops through another compile path with its own key and layout,
  so a warm-up in one mode serves no run in the other: the mode is part of `settings`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...adapters.host import installed_versions
from ...errors import CacheError, UsageError

# The `torch_neuronx.metrics` counters read (totals of this process); with the `_C._get_compilation_cache_stats()`
# dict's keys, the names that mean a compile or a persistent-cache hit.
METRIC_COUNTERS = (
    "CompilationCache.PersistentHits",
    "CompilationCache.PersistentMisses",
    "CompilationCache.TotalCompilations",
)
# The stats call's counters (its other keys are sizes, times and ratios).
STATS_COUNTERS = ("in_memory_hits", "in_memory_misses", "persistent_hits", "persistent_misses", "total_compilations")
COMPILES = ("total_compilations", "CompilationCache.TotalCompilations")
FILES = "neff_files"  # what tells a compile where no counter moves (sync mode's eager ops)
HITS = ("persistent_hits", "CompilationCache.PersistentHits")
# Settings in the NEFF cache key besides the platform target (KernelExecution.cpp): equal in warm-up and training.
KEY_ENV = ("NEURON_CC_FLAGS", "NEURON_LOGICAL_NC_CONFIG", "NEURON_COMPILER_OPT_LEVEL")
SYNC_ENV = "NEURON_LAUNCH_BLOCKING"  # "1": sync mode (PlatformUtils.cpp IsSyncModeEnabled compares with "1")
# Sync mode's Python compile path (eager ops) compiles at a fixed -O1 with no extra flags, whatever the variables
# say (kernels/compiler_config.py:16-35, python_ops/compilation/hlo_compiler.py:14-43): recorded so, two hosts that
# differ only there share an eager sync-mode cache. `torch.compile` graphs still take the C++ path, which keys them.
SYNC_COMPILER = {"NEURON_CC_FLAGS": "none (sync mode's fixed flags)",
                 "NEURON_COMPILER_OPT_LEVEL": "-O1 (sync mode's fixed level)"}
METRICS_ENV = "TORCH_NEURONX_METRICS_ENABLED"
# TORCH_NEURONX_* variables that only say where things go, what is logged or measured; every other one may change
# the compiled code (e.g. TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS, TORCH_NEURONX_MLIR_ATEN_OPS).
NOT_CODE = ("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", METRICS_ENV,
            "TORCH_NEURONX_METRICS_DIR", "TORCH_NEURONX_ENABLED_METRIC_TABLES", "TORCH_NEURONX_ENABLE_STACK_TRACE",
            "TORCH_NEURONX_LOG_LEVEL", "TORCH_NEURONX_LOG_FILE", "TORCH_NEURONX_DEBUG_DIR",
            "TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT", "TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS")
# What turns the NEFF cache off: the persistent tier ("1" in C++, PersistentCacheBackend.cpp:55-59; 1/true/yes in
# the sync path, kernels/cache_utils.py:18-20) and the in-process one (1/true/yes, utils.py:191-198).
DISABLE_ENV = ("TORCH_NEURONX_NEFF_DISABLE_CACHE", "TORCH_NEURONX_DISABLE_NEFF_CACHE")
# What a `torch.compile` graph's NEFF key depends on besides the settings: the key hashes the graph's MLIR bytecode,
# which keeps each op's location, the file and line of the FX node's stack trace (neuron_dynamo_backend/compile.py:
# 103-113, fx/fx_importer.py:28-40, cache/CacheUtils.cpp:11-35); eager keys print no locations (python_ops/
# torch_mlir/kernel.py:374). So a compiled-graph cache serves only a host whose model code sits at the same paths.
SOURCE_PATHS = ("python prefix", "site-packages", "HF modules dir")
UNSET = "<unset>"  # a key variable that is not set: upstream reads an empty value as set (PlatformUtils.cpp)
# TorchNeuron's in-process compile cache as two bindings of the April tree show it (NeuronBindings.cpp; a release may
# lack them): every entry's key, with the milliseconds its compile took, 0 for a NEFF loaded from the persistent
# cache (CompilationCache.cpp makes a persistent hit an entry of 0 ms); and the keys alone.
ENTRIES = "_get_compilation_cache_entries"
ALL_KEYS = "_get_all_cache_keys"
# The C++ cache key (KernelExecution.cpp GenerateCacheKey): the op's (or compiled graph's) own key, then the platform
# target, the logical cores, the opt level without its dash and the compiler args: "--model-type transformer
# --auto-cast=none", then " " and NEURON_CC_FLAGS where set, spaces made "_" and "=" made "-".
_KEY = re.compile(r"(?P<graph>.+)_(?P<target>[a-z]+[0-9][a-z0-9]*)_(?P<lnc>[^_]*)_(?P<opt>[^_]*)"
                  r"_--model-type_transformer_--auto-cast-none(?:_(?P<flags>.*))?", re.DOTALL)
KEY_PARTS = ("op or graph", "target", "logical cores", "opt level", "NEURON_CC_FLAGS")
# What a neuronx-cc killed by a signal means (the numbers also as a shell, 128+N, and a Python wrapper exiting with
# -N, 256-N, report them), as vLLM-Neuron explains them.
COMPILER_SIGNALS = {
    9: "neuronx-cc was killed (signal 9), most often by the out-of-memory killer: the compile needed more host "
       "memory than was free; warm with fewer --workers (or a larger --worker-memory-gib), or on a host with more "
       "memory, then warm again (the shape is retried)",
    6: "neuronx-cc aborted (signal 6): an internal compiler error; its log is in the compile's work dir under "
       "TORCH_NEURONX_DEBUG_DIR (default /tmp/neuron_backend): report it to the Neuron SDK with this shape",
    11: "neuronx-cc crashed (signal 11, a segmentation fault): a compiler bug, or memory exhausted mid-compile; "
        "warm the shape again alone (--workers 1), and report it to the Neuron SDK with this shape if it recurs",
}
_EXIT = re.compile(r"(?:return|exit|error) code:?\s*(-?[0-9]+)|returned:?\s*(-?[0-9]+)", re.IGNORECASE)
# The logical-core config each platform defaults to when NEURON_LOGICAL_NC_CONFIG is unset (PlatformUtils.cpp).
DEFAULT_LNC = {"trn2": "2", "trn3": "2", "trn1": "1"}
# Physical NeuronCores per Neuron device (/dev/neuronN).
CORES_PER_DEVICE = {"trn2": 8, "trn3": 8}
# A bound on core ids and counts read from the environment, far above the largest host (a trn2u.48xlarge has 128
# logical cores at LNC=1), so that a typo is refused before a list of that size is made.
MAX_CORES = 4096
# Where TorchNeuron writes NEFFs and takes its locks without a setting of its own: fixed paths, whatever TMPDIR says
# (PersistentCacheBackend.cpp, kernels/cache_utils.py, CompilationCache.cpp).
DEFAULT_CACHE_DIR = Path("/tmp/neff_cache")
DEFAULT_LOCK_DIR = Path("/tmp/local_cache")
# Where EC2 (Nitro) exposes the instance type: what tells a Trn1 host before torch-neuronx loads.
INSTANCE_TYPE_FILE = Path("/sys/devices/virtual/dmi/id/product_name")
DEVICE_DIR = Path("/dev")
FIRST_NATIVE = (2, 13)
INSTALL = "pip install shapeplan[neuron] --extra-index-url https://pip.repos.neuron.amazonaws.com"
MISSING = (f"--device neuron needs torch-neuronx, which is not installed; run `{INSTALL}` on a Trainium (Trn2/Trn3) "
           "host with the Neuron SDK, or pass --device cpu")
NATIVE = ("TorchNeuron: torch-neuronx >= 2.13 on a Trn2/Trn3 host, installed from the Neuron pip index; or pass "
          "--device cpu")


def _loaded() -> Any:
    """torch_neuronx when this process has imported it (then its runtime answers), else None."""
    return sys.modules.get("torch_neuronx")


def platform_target() -> str:
    """trn2 / trn3 / trn1 as the runtime reports it (`_C._get_platform_target()`) once torch-neuronx is loaded;
    before that from the EC2 instance type; "unknown" where neither tells."""
    runtime = getattr(getattr(_loaded(), "_C", None), "_get_platform_target", None)
    if runtime is not None:
        try:
            return str(runtime())
        except RuntimeError:  # "Failed to get Neuron instance information": no Neuron instance
            return "unknown"
    try:
        instance = INSTANCE_TYPE_FILE.read_text(encoding="ascii").strip()
    except OSError:
        return "unknown"
    family = instance.split(".")[0]
    if family.startswith(("trn1", "inf2")):
        return "trn1"
    return family[:4] if family.startswith(("trn2", "trn3")) else "unknown"


def logical_nc_config(target: str) -> str:
    """NEURON_LOGICAL_NC_CONFIG as the compiler sees it: the variable whenever it is set (even empty), else the
    platform's default."""
    if "NEURON_LOGICAL_NC_CONFIG" in os.environ:
        return os.environ["NEURON_LOGICAL_NC_CONFIG"]
    return DEFAULT_LNC.get(target, "default")


def parse_cores(text: str) -> list[int]:
    """NEURON_RT_VISIBLE_CORES as a sorted list of core ids: one index ("3") or an inclusive range ("4-7"), the
    forms the runtime guide documents (comma lists of those are read too)."""
    shown = repr(text if len(text) <= 40 else text[:40] + "...")
    cores: set[int] = set()
    for item in text.replace(" ", "").split(","):
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", item)
        if match is None:
            raise UsageError(f"NEURON_RT_VISIBLE_CORES={shown} is not a core index or range; use e.g. 0-3")
        # clipped to the bound before int(): a 5000-digit id is refused, not converted
        first, last = (int(m) if len(m) <= 6 else MAX_CORES for m in (match[1], match[2] or match[1]))
        if last >= MAX_CORES:
            raise UsageError(f"NEURON_RT_VISIBLE_CORES={shown} names a core past the {MAX_CORES} logical "
                             "NeuronCores any host has; use the indexes `neuron-ls` shows")
        if last < first:
            raise UsageError(f"NEURON_RT_VISIBLE_CORES={shown} holds a range that ends before it starts; use e.g. "
                             "0-3")
        cores.update(range(first, last + 1))
    return sorted(cores)


def requested_cores() -> int | None:
    """$NEURON_RT_NUM_CORES as the runtime reads it where NEURON_RT_VISIBLE_CORES is unset (which wins, guide Notes
    5): n free cores the runtime picks, not cores 0..n-1 (configuration-guide.rst:128); None for unset or 0, the
    documented default, "interpreted as all" (:33-38)."""
    text = os.environ.get("NEURON_RT_NUM_CORES", "")
    if not text or os.environ.get("NEURON_RT_VISIBLE_CORES"):
        return None
    if not text.isascii() or not text.isdigit():  # str.isdigit() alone takes digits int() refuses ("²")
        raise UsageError(f"NEURON_RT_NUM_CORES={text[:20]!r} is not a number of cores; use e.g. 4 (or 0 for all)")
    if len(text.lstrip("0")) > len(str(MAX_CORES)) or int(text) > MAX_CORES:
        raise UsageError(f"NEURON_RT_NUM_CORES={text[:20]!r} is more than the {MAX_CORES} logical NeuronCores any "
                         "host has; use e.g. 4")
    return int(text) or None


def visible_cores() -> list[int] | None:
    """The logical NeuronCores this process may use: $NEURON_RT_VISIBLE_CORES, else as many as $NEURON_RT_NUM_CORES
    asks for (numbered from 0 here, though the runtime picks which), else the runtime's count where torch-neuronx is
    loaded, else every core of the host's Neuron devices at its logical-core config; None where that cannot be told
    (no /dev/neuron*, unknown platform)."""
    if os.environ.get("NEURON_RT_VISIBLE_CORES"):
        return parse_cores(os.environ["NEURON_RT_VISIBLE_CORES"])
    requested = requested_cores()
    if requested is not None:
        return list(range(requested))
    if _loaded() is not None:
        import torch

        return list(range(int(torch.neuron.device_count())))  # type: ignore[attr-defined]  # registered by torch-neuronx
    target = platform_target()
    lnc = logical_nc_config(target)
    devices = neuron_devices()
    if not devices or target not in CORES_PER_DEVICE or not lnc.isdigit() or int(lnc) < 1:
        return None
    return list(range(devices * CORES_PER_DEVICE[target] // int(lnc)))


def lock_dir() -> Path:
    """Where TorchNeuron takes its compile locks; importing it creates this and the cache dir."""
    return Path(os.environ.get("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR") or DEFAULT_LOCK_DIR)


def neuron_devices() -> int:
    return sum(1 for p in DEVICE_DIR.glob("neuron*") if p.name[6:].isdigit())


def autoload_failed(exc: BaseException) -> bool:
    """Whether `import torch` failed because its autoload of torch-neuronx did (torch `_import_device_backends`)."""
    return isinstance(exc, RuntimeError) and "backend extension: torch_neuronx" in str(exc)


def unimportable(exc: BaseException) -> str:
    """One line for a torch-neuronx that fails to import: on a host without Neuron devices (an AMI built on a CPU
    instance) what works there and what needs the device; else the package's own error and the dirs its import
    creates."""
    cause = exc.__cause__ or exc
    said = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    if not neuron_devices():
        return (f"torch-neuronx cannot import on this host, which has no Neuron device (/dev/neuron*): {said}; "
                "`cache inspect`, `cache export`, `cache push` and `cache ls` work here, while `cache import`, "
                "`cache pull`, `warm`, `verify` and `doctor --device neuron` need a Trn2/Trn3 instance (run them "
                "there, e.g. as a build step on one)")
    return (f"torch-neuronx failed to import: {said}; its import creates the NEFF cache dir "
            f"(TORCH_NEURONX_NEFF_CACHE_DIR, default {DEFAULT_CACHE_DIR}) and the lock dir "
            f"(TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR, default {DEFAULT_LOCK_DIR}): both must be creatable")


def installed_version() -> str | None:
    return installed_versions(("torch-neuronx",))["torch-neuronx"]


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("+")[0].split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def require_torch_neuronx() -> None:
    """Refuse, before anything loads, a host where TorchNeuron cannot run: no torch-neuronx, the XLA-era package
    (< 2.13) or a trn1/inf2 host."""
    if importlib.util.find_spec("torch_neuronx") is None:
        raise UsageError(MISSING)
    version = installed_version()
    if version is not None and _release(version)[:2] < FIRST_NATIVE:
        raise UsageError(f"torch-neuronx {version} is the PyTorch/XLA stack, which shapeplan does not warm; "
                         f"use {NATIVE}")
    _refuse_trn1()


def _refuse_trn1() -> None:
    if platform_target() == "trn1":
        raise UsageError(f"this is a Trn1/Inf2 host, which TorchNeuron does not support; use {NATIVE}")


def count_neffs(cache_dir: Path) -> int:
    """NEFF files in the cache (both layouts: ab/cd/<key>.neff and <sha>/<sha>.neff; temporaries end otherwise),
    empty ones left out: TorchNeuron reads a file of size 0 as a miss."""
    return sum(1 for path in cache_dir.rglob("*.neff") if _nonempty(path))


def count_sync_neffs(cache_dir: Path) -> int:
    """NEFFs of sync mode's Python compile path only (`<sha256>/<sha256>.neff`, kernels/compiler_subprocess.py): two
    levels deep, not a walk of the whole cache."""
    return sum(1 for path in cache_dir.glob("*/*.neff")
               if path.stem == path.parent.name and len(path.stem) == 64 and _nonempty(path))


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def key_parts(key: str) -> dict[str, str]:
    """A C++ cache key in its parts (KEY_PARTS), or {"key": key} for a key of another layout (a later release)."""
    match = _KEY.fullmatch(key)
    if match is None:
        return {"key": key}
    return dict(zip(KEY_PARTS, (match["graph"], match["target"], match["lnc"], match["opt"],
                                UNSET if match["flags"] is None else match["flags"]), strict=True))


def key_differences(key: str, warmed: Mapping[str, Any]) -> str:
    """How `key` differs from the closest of the `warmed` keys that compile the same op or graph (the parts that
    differ), or that none does."""
    if key in warmed:
        return "the warm-up met this same key"
    parts = key_parts(key)
    graph = parts.get("op or graph", parts.get("key", ""))
    same = [other for other in map(key_parts, warmed) if other.get("op or graph") == graph]
    if "key" in parts or not same:
        return f"no key the warm-up recorded has its op or graph ({graph[:160]})"

    def shown(value: str) -> str:
        return value if value == UNSET else repr(value)

    differing = min(([(name, other[name], parts[name]) for name in KEY_PARTS if other[name] != parts[name]]
                     for other in same), key=len)
    return "; ".join(f"{name} {shown(was)} -> {shown(now)}" for name, was, now in differing)


def check_keys(label: str, warmed: Mapping[str, int | None], held: Mapping[str, int | None],
               new: Mapping[str, int | None]) -> list[str]:
    """What `verify` says of a shape whose warm-up recorded the keys `warmed`, given the keys this process `held`
    after it ran (with their compile milliseconds: 0 loaded from the cache dir, more compiled here) and the `new`
    ones it met first: the warmed keys it did not meet, and each key it compiled, with its parts."""
    out = []
    missing = [k for k in warmed if k not in held]
    if missing:
        out.append(f"verify: {label}: {len(missing)} of {len(warmed)} key(s) the warm-up recorded were not met "
                   f"(e.g. {missing[0]!r}): this run's step runs other ops or graphs than the warm-up's")
    for key, milliseconds in new.items():
        if not milliseconds:  # loaded (0), or unknown (only the keys binding)
            continue
        if key in warmed:
            out.append(f"verify: {label} compiled again a key the warm-up compiled ({key!r}, {milliseconds} ms): "
                       "its NEFF is not in the cache dir, or was not read")
        else:
            out.append(f"verify: {label} compiled key {key!r} ({milliseconds} ms): {key_differences(key, warmed)}")
    return out


def explain_failure(error: str) -> str:
    """`error` (a failed shape's line) with what a neuronx-cc that was killed or crashed means, where it says so:
    sync mode's compile path reports the signal as return code -N; TorchNeuron's C++ path reads the status with
    WEXITSTATUS, so a compiler killed by a signal reads as exit 0 and the failure is the NEFF it did not write
    (NeuronCompiler.cpp), while a compiler that exits with a code reports it."""
    if "compil" not in error.lower() and "neuronx-cc" not in error:
        return error
    if "Failed to read compiled NEFF file" in error:
        return (f"{error} (neuronx-cc wrote no NEFF and reported no error: TorchNeuron reads a compiler killed by a "
                f"signal as exit 0, and the likeliest signal is 9; {COMPILER_SIGNALS[9]})")
    for match in _EXIT.finditer(error):
        code = int(match[1] or match[2])
        signal = -code if code < 0 else code - 128 if 128 < code < 160 else 256 - code if code > 240 else 0
        if signal in COMPILER_SIGNALS:
            return f"{error} (exit {code}: {COMPILER_SIGNALS[signal]})"
    return error


def version_notes(recorded: Mapping[str, Any], here: Mapping[str, Any]) -> list[str]:
    """Why a cache warmed under another torch-neuronx or neuronx-cc build than this machine's is not used here."""
    out = []
    warmed, installed = recorded.get("torch-neuronx"), here.get("torch-neuronx")
    if isinstance(warmed, str) and isinstance(installed, str) and warmed != installed and \
            _release(warmed)[:3] == _release(installed)[:3]:
        line = ".".join(map(str, _release(installed)[:3]))
        if len(_release(warmed)) < 4:
            out.append(f"the warm-up recorded torch-neuronx {warmed} without its fourth (build) part, so which build "
                       f"of {line} warmed it cannot be told; warm it again here")
        else:
            out.append(f"torch-neuronx {warmed} and {installed} are two builds of torch-neuronx {line}: Neuron 2.34 "
                       f"(2.13.3.1, 2.14.3.1) fixed a cache reuse issue it does not name, so NEFFs warmed under one "
                       f"build are not proven under the other; warm the cache again under {installed} (docs/neuron.md)")
    compiler, installed_compiler = recorded.get("neuronx-cc"), here.get("neuronx-cc")
    if isinstance(compiler, str) and isinstance(installed_compiler, str) and compiler != installed_compiler and \
            "none" not in (compiler, installed_compiler):
        out.append(f"neuronx-cc {compiler} and {installed_compiler} are two compilers: sync mode's keys hold the "
                   "compiler version and the C++ keys do not, so TorchNeuron might load the other compiler's NEFFs, "
                   "which shapeplan does not vouch for; warm the cache again under this one")
    return out


def rank_warnings(cache_dir: Path, *, environment: str | None = None) -> list[tuple[str, str]]:
    """(what it costs, how to share one) for a cache dir, or the environment's TORCH_NEURONX_NEFF_CACHE_DIR (which
    training reads), whose path names a rank: such a dir differs between the ranks of a run."""
    from ..cachedir import rank_in_path, without_rank

    out = []
    for shown, path in ((f"cache dir {cache_dir}", str(cache_dir)),
                        (f"this environment's TORCH_NEURONX_NEFF_CACHE_DIR={environment}", environment)):
        rank = rank_in_path(path) if path else None
        if path and rank:
            out.append((f"{shown} holds a rank ({rank}): with a cache dir per rank, ranks 1..N never read what rank 0 "
                        "compiled, nor what a warm-up compiled into another dir, and each rank compiles every NEFF "
                        "again",
                        "TorchNeuron's NEFF cache is safe for many processes (atomic renames, a lock per key in the "
                        f"local lock dir), so use one dir for every rank (e.g. {without_rank(path)}) and warm that "
                        "one"))
    return out


def network_warnings(cache_dir: Path, locks: Path) -> list[tuple[str, str]]:
    """(what it costs, what to do) for a cache dir or a lock dir on a network file system (/proc/mounts)."""
    from ..cachedir import network_file_system

    out = []
    network = network_file_system(cache_dir)
    if network is not None:
        out.append((f"cache dir {cache_dir} is on {network[1]} (mounted at {network[0]}): TorchNeuron's NEFF cache "
                    "works on shared storage (atomic renames; its locks stay on local disk), which is how hosts and "
                    "ranks share one, but every NEFF a run loads is read over the network",
                    "if start-up is slow, `shapeplan cache export` it and import it onto local disk"))
    network = network_file_system(locks)
    if network is not None:
        out.append((f"TorchNeuron's lock dir {locks} (TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR) is on {network[1]} "
                    f"(mounted at {network[0]}): its compile locks are flock()s, which a network file system does "
                    "not hold reliably across hosts, and TorchNeuron keeps them on local storage on purpose "
                    "(CompilationCache.cpp)", f"point it at a local folder (default {DEFAULT_LOCK_DIR})"))
    return out


def cache_disabled() -> list[str]:
    """The set variables that turn TorchNeuron's NEFF cache off, as `NAME=value`."""
    return [f"{name}={os.environ[name]}" for name in DISABLE_ENV
            if os.environ.get(name, "").lower() in ("1", "true", "yes")]


def refuse_disabled_cache() -> None:
    disabled = cache_disabled()
    if disabled:
        raise UsageError(f"{' and '.join(disabled)} turns TorchNeuron's NEFF cache off, so nothing warmed would be "
                         f"kept; unset {' and '.join(d.split('=')[0] for d in disabled)}")


def sync_mode() -> bool:
    """Whether eager ops take sync mode's compile path (read after torch-neuronx's import set its default)."""
    return os.environ.get(SYNC_ENV) == "1"


def enable_metrics() -> str | None:
    """Turn on the compile counters of this process: the variable for a torch-neuronx not yet loaded (read at its
    first counter use), `torch_neuronx.metrics.set_enabled(True)` for one already loaded. Returns why compiles
    cannot be counted, or None."""
    os.environ[METRICS_ENV] = "1"
    if _loaded() is None:
        return None
    try:
        metrics = importlib.import_module("torch_neuronx.metrics")
    except ImportError:
        return None  # the stats call, if any, reads the same arena: `counters` says when there is neither
    if hasattr(metrics, "set_enabled"):
        metrics.set_enabled(True)
    if hasattr(metrics, "is_enabled") and not metrics.is_enabled():
        return (f"torch-neuronx's metrics are off ({METRICS_ENV} was read before it was set) and cannot be switched "
                f"on, so compiles are not counted; start the run with {METRICS_ENV}=1")
    return None


class NeuronBackend:
    name = "neuron"
    device = "neuron"
    counting = True  # the compile counters count (metrics on), as `counters` last read it

    def __init__(self) -> None:
        require_torch_neuronx()
        self.cache_dir: Path | None = None  # where NEFF files are counted: None counts none
        self.torch_compile = False  # the warm-up compiles graphs: their keys depend on source paths
        self.warnings: list[str] = []  # what `prepare` found that keeps the cache from serving every rank
        self._loaded: Any = None  # torch_neuronx, once imported and checked

    def prepare(self, cache_dir: Path, *, scratch: Path | None = None) -> None:
        refuse_disabled_cache()
        self.cache_dir = cache_dir
        before = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
        os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(cache_dir)
        if scratch is not None:  # compile locks go to a local dir that must be writable (neuron.md 2.1)
            os.environ["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"] = str(scratch / "locks")
        found = [*rank_warnings(cache_dir, environment=before if before != str(cache_dir) else None),
                 *network_warnings(cache_dir, lock_dir())]
        self.warnings = [f"{said}; {fix}" for said, fix in found]
        enable_metrics()

    def watch(self) -> str | None:
        """Count compiles in a run that shapeplan did not prepare (the guard): metrics on; in sync mode, whose eager
        compiles move no counter, also sync mode's NEFF files in the cache dir the run uses (in async mode the
        counters alone: the files of a shared dir are every rank's, and no step boundary walks the cache). Returns
        why compiles cannot be counted, or None."""
        reason = enable_metrics()
        self._module()  # its import sets the mode's default
        self.cache_dir = Path(os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR") or DEFAULT_CACHE_DIR) \
            if sync_mode() else None
        return reason

    def configure(self, *, torch_compile: bool, graphs: int) -> None:
        self.torch_compile = torch_compile
        if torch_compile:
            from .inductor import apply_dynamo_settings

            apply_dynamo_settings(graphs)

    def compiles(self, *, torch_compile: bool) -> bool:
        return True  # every graph the device runs is compiled, eager or not

    def _module(self) -> Any:
        """torch_neuronx, imported (`import torch` autoloads it; its import applies its environment defaults) and
        checked once: `counters` calls this at every shape and step boundary."""
        if self._loaded is not None:
            return self._loaded
        try:
            import torch

            module = importlib.import_module("torch_neuronx")
        except (RuntimeError, OSError) as exc:  # torch's autoload wraps the package's own error
            raise UsageError(unimportable(exc)) from None
        if getattr(torch, "neuron", None) is None:  # the XLA-era package registers no `neuron` device
            raise UsageError(f"torch-neuronx {getattr(module, '__version__', '')} has no torch.neuron device (the "
                             f"PyTorch/XLA stack); use {NATIVE}")
        _refuse_trn1()  # now from the runtime's own platform target
        self._loaded = module
        return module

    def sources(self) -> dict[str, bool]:
        """Which counter sources this torch-neuronx has: the private stats call and the metrics module."""
        module = self._module()
        try:
            importlib.import_module("torch_neuronx.metrics")  # not imported by torch_neuronx/__init__.py
            has_metrics = True
        except ImportError:
            has_metrics = False
        return {"_C._get_compilation_cache_stats": hasattr(getattr(module, "_C", None), "_get_compilation_cache_stats"),
                "torch_neuronx.metrics": has_metrics}

    def counters(self) -> dict[str, int]:
        """Compile counters after the compile thread has finished, and the NEFF files in the cache dir."""
        import torch

        sources = self.sources()
        torch.neuron.synchronize()  # type: ignore[attr-defined]  # registered by torch-neuronx
        module = self._module()
        out: dict[str, int] = {}
        if sources["_C._get_compilation_cache_stats"]:
            stats = module._C._get_compilation_cache_stats()
            out.update((name, int(stats[name])) for name in STATS_COUNTERS if name in stats)
        if sources["torch_neuronx.metrics"]:
            metrics = importlib.import_module("torch_neuronx.metrics")
            for name in METRIC_COUNTERS:
                out[name] = int(metrics.get_counter_value(name) or 0)
            # metrics that stayed off count nothing: then files are all that tells a compile
            self.counting = bool(metrics.is_enabled()) if hasattr(metrics, "is_enabled") else True
        if not any(sources.values()):
            raise CacheError(f"torch-neuronx {module.__version__} has neither _C._get_compilation_cache_stats nor "
                             "torch_neuronx.metrics, so compiles cannot be counted; use a TorchNeuron release that "
                             "has one (2.13/2.14)")
        if self.cache_dir is not None:
            out[FILES] = count_sync_neffs(self.cache_dir) if sync_mode() else count_neffs(self.cache_dir)
        return out

    def compile_keys(self) -> dict[str, int | None] | None:
        """The keys of TorchNeuron's in-process compile cache, each with its compile milliseconds (0: loaded from the
        cache dir; None: only the keys binding exists), after the compile thread has finished; None where
        torch-neuronx has neither binding (the counters alone then tell)."""
        runtime = getattr(self._module(), "_C", None)
        entries, keys = getattr(runtime, ENTRIES, None), getattr(runtime, ALL_KEYS, None)
        if entries is None and keys is None:
            return None
        import torch

        torch.neuron.synchronize()  # type: ignore[attr-defined]  # registered by torch-neuronx
        if entries is not None:
            return {str(e["cache_key"]): int(e["compilation_time_ms"]) for e in entries()}
        assert keys is not None  # one of the two exists
        return dict.fromkeys(map(str, keys()))

    check_keys = staticmethod(check_keys)
    key_parts = staticmethod(key_parts)  # what the guard names of a key a training step compiled
    explain_failure = staticmethod(explain_failure)

    def compiled(self, delta: Mapping[str, int]) -> bool:
        """This process compiled: its compile counter moved, or (sync mode's eager ops, which move none; metrics that
        stayed off) new NEFFs appeared. While the counters count, in async mode a new file may be another process's
        compile: it decides nothing."""
        return any(delta.get(name, 0) > 0 for name in COMPILES) or \
            ((sync_mode() or not self.counting) and delta.get(FILES, 0) > 0)

    def hit(self, delta: Mapping[str, int]) -> bool:
        return any(delta.get(name, 0) > 0 for name in HITS)

    def settings(self) -> dict[str, str]:
        """Versions, platform target, execution mode and every code-changing setting (for `torch_compile` also the
        source paths compiled graphs' keys depend on), read after torch-neuronx's import has set its defaults (so
        every command describes one host the same way), normalized so that settings the compiler sees as equal
        (NEURON_LOGICAL_NC_CONFIG unset or the platform default) read equal."""
        self._module()
        target = platform_target()
        out = {"backend": "neuron", "device": "neuron", "target": target}
        out.update((name, version or "none")
                   for name, version in installed_versions(("torch", "torch-neuronx", "neuronx-cc")).items())
        out["NEURON_CC_FLAGS"] = os.environ.get("NEURON_CC_FLAGS", UNSET)
        out["NEURON_LOGICAL_NC_CONFIG"] = logical_nc_config(target)
        # any set value, "" too, is passed on and keyed (KernelExecution.cpp:76-82)
        out["NEURON_COMPILER_OPT_LEVEL"] = os.environ.get("NEURON_COMPILER_OPT_LEVEL", "default")
        out[SYNC_ENV] = "1 (sync)" if sync_mode() else "async"
        out.update((name, os.environ[name]) for name in code_settings())
        out.update(source_paths())
        return out if self.torch_compile else eager_settings(out)

    def script_lines(self, cache_dir: Path, *, torch_compile: bool, graphs: int) -> tuple[str, ...]:
        lines = [f"export TORCH_NEURONX_NEFF_CACHE_DIR={cache_dir}", f"export {SYNC_ENV}={1 if sync_mode() else 0}"]
        lines += [f"export {name}={os.environ[name]}" for name in KEY_ENV if name in os.environ]
        lines += [f"export {name}={os.environ[name]}" for name in code_settings()]
        if torch_compile:
            from .inductor import dynamo_lines

            lines += dynamo_lines(graphs)
        return tuple(lines)


def source_paths() -> dict[str, str]:
    """Where the code a compiled graph's source locations name lives: the interpreter prefix, its site-packages
    (torch, transformers, TRL, the model classes) and transformers' modules dir (trust_remote_code models)."""
    import sysconfig

    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    values = (sys.prefix, sysconfig.get_paths()["purelib"], os.environ.get("HF_MODULES_CACHE")
              or os.path.join(home, "modules"))
    return dict(zip(SOURCE_PATHS, values, strict=True))


def eager_settings(compiler: dict[str, str]) -> dict[str, str]:
    """A Neuron host's settings as an eager warm-up records them: without the source paths only compiled graphs'
    keys hold, and in sync mode with its Python path's fixed compiler settings."""
    out = {name: value for name, value in compiler.items() if name not in SOURCE_PATHS}
    if out.get(SYNC_ENV) == "1 (sync)":
        out.update(SYNC_COMPILER)
    return out


def code_settings() -> list[str]:
    """The set TORCH_NEURONX_* variables that may change compiled code, sorted."""
    return sorted(k for k in os.environ if k.startswith("TORCH_NEURONX_") and k not in NOT_CODE)
