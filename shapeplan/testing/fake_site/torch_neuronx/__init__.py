"""A fake torch_neuronx (TorchNeuron, the native backend) for tests, as strict as the April 2026 source
(parmoham-aws/test-repo-parmoham @98154b8; research/neuron-audit.md). Put shapeplan/testing/fake_site on sys.path
(in-process: shapeplan.testing.FakeNeuron; subprocesses: shapeplan.testing.fake_env, where `import torch` autoloads
it through the `torch.backends` entry point, as the real package is loaded) and choose its variants with
FAKE_NEURON, a comma list:

    device              "neuron" is the PrivateUse1 device (a Trainer runs on it); its tensors live on the CPU and
                        report device neuron:0; each op on one (name + input shapes/dtypes) is a kernel of the
                        compile cache, while host-only ops and copies to the host are not;
                        `torch.compile(backend="neuron")` graphs are kernels too
    async               compiles run on a background "thread": counters and files settle at synchronize()
    release_build       the wheel's build config is RELEASE: `import torch` defaults NEURON_LAUNCH_BLOCKING to 1
                        (sync mode) and TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS to 0 (_build_config.py)
    cache_failed        the persistent cache failed to start ("continuing without persistent caching"): nothing is
                        looked up or written and no persistent miss is counted; compiles still happen
    no_metrics          there is no torch_neuronx.metrics module
    no_stats            there is no _C._get_compilation_cache_stats
    metrics_off         the metrics stay off although TORCH_NEURONX_METRICS_ENABLED=1 (a release reading another name)
    xla                 an XLA-era package: no torch.neuron and no stats call
    renamed_cache_var   the cache dir is read from TORCH_NEURONX_NEFF_CACHE_PATH, not TORCH_NEURONX_NEFF_CACHE_DIR
    no_device           the runtime sees no NeuronCore (torch.neuron.is_available() is False)
    no_instance         a host without a Neuron instance (an AMI built on a CPU instance): the import fails
    no_cache_entries    there is no _C._get_compilation_cache_entries nor _C._get_all_cache_keys (a release without
                        the April bindings)

What the source does, and so the fake:
- `import torch_neuronx` sets defaults for nine variables (`__init__.py:44-65`), NEURON_LAUNCH_BLOCKING among them.
- Every counter, the `torch_neuronx.metrics` ones and `_C._get_compilation_cache_stats()` alike, reads one arena
  that counts only while metrics are enabled: TORCH_NEURONX_METRICS_ENABLED (1/true/TRUE/yes/YES) is read once, at
  the first counter use; `torch_neuronx.metrics.set_enabled` switches it later (NeuronMetrics.h/.cpp).
- The cache dir (TORCH_NEURONX_NEFF_CACHE_DIR, default /tmp/neff_cache whatever TMPDIR says) and the lock dir
  (TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR, default /tmp/local_cache) are created by the import (sync mode's
  CompilerSubprocess, built at import) and read again by the C++ cache at its first use. A lock dir that cannot be
  created fails the import; a lock file that cannot be opened fails the compile. The import fails on a host without
  a Neuron instance (its CompilerConfig asks the runtime for the platform target).
- A NEFF file of size 0 is a miss (PersistentCacheBackend::Get). TORCH_NEURONX_NEFF_DISABLE_CACHE turns the
  persistent tier off ("1" in C++, 1/true/yes in the sync path); TORCH_NEURONX_DISABLE_NEFF_CACHE (1/true/yes) turns
  the sync path's in-process tier off.
- Async mode (NEURON_LAUNCH_BLOCKING != "1"), and every `torch.compile` graph: the C++ cache. A kernel the process
  has not met is a persistent miss unless `ab/cd/<32 hex>.neff` exists; after a miss the compile takes the file lock
  `<lock dir>/locks/<key>.lock` and reads the disk again: a NEFF another process wrote meanwhile is a persistent
  hit, not a compile. Only `total_compilations` counts compiles (CompilationCache.cpp). Files are written through a
  `.tmp.XXXXXX` temporary in the shard dir and a rename. The key holds NEURON_CC_FLAGS and
  NEURON_COMPILER_OPT_LEVEL where they are set, an empty value too (KernelExecution.cpp:76-82).
- Sync mode (NEURON_LAUNCH_BLOCKING=1), eager ops: the Python compile path (kernels/compiler_subprocess.py), with
  the cache and lock dirs the import saw, keyed with the neuronx-cc version, `<sha256>/<sha256>.neff` written
  through `tmp*.tmp`, locks in `<lock dir>/<key>/locks/compile.lock`, and no counter moves. It compiles at a fixed
  -O1 with no extra flags: NEURON_CC_FLAGS and NEURON_COMPILER_OPT_LEVEL are not read there
  (kernels/compiler_config.py:16-35, python_ops/compilation/hlo_compiler.py:14-43), nor keyed.
- The built-in NKI flash attention (SDPA with no mask, no dropout, both sequence lengths multiples of 512, head_dim
  <= 128) keys its cache with Python's `hash()` of the shapes and dtypes (nki_op_impl.py:19-25), which differs in
  every process: it never hits across processes.
- The C++ cache's key (KernelExecution.cpp GenerateCacheKey) is the op's (or graph's) own key, then
  `_<target>_<lnc>_<opt level without its dash>_<compiler args>`: the args are "--model-type transformer
  --auto-cast=none", then " " and NEURON_CC_FLAGS where set, with spaces made "_" and "=" made "-"; the opt level is
  NEURON_COMPILER_OPT_LEVEL where set, else -O1 for eager ops and -O2 for compiled graphs. Its in-process tier holds
  one entry per key: `_C._get_compilation_cache_entries()` lists them (cache_key, neff_size_bytes, access_count,
  compilation_time_ms: 0 for a NEFF loaded from the cache dir, the compile's milliseconds otherwise; a real compile
  runs neuronx-cc as a process, so the fake's takes at least 1 ms) and `_C._get_all_cache_keys()` their keys
  (NeuronBindings.cpp, CompilationCache.cpp GetCacheEntries/GetAllCacheKeys); an entry appears once its compile is
  done, an in-process hit counts an access, and the metrics switch gates neither. Sync mode's Python path has no
  entries.
- A failed neuronx-cc (FAKE_NEURON_COMPILER_EXIT: "-N" killed by signal N, else its exit status) fails the compile as
  upstream words it: the C++ path reads the status with WEXITSTATUS, so a compiler killed by a signal reads as exit 0
  and the failure is the missing NEFF ("Failed to read compiled NEFF file", NeuronCompiler.cpp); an exit status
  fails with "Command failed (neuronx-cc compilation) with exit code N"; both wrapped as "HLO to NEFF compilation
  failed for op '...'" (KernelExecution.cpp). Sync mode's subprocess.run sees "-N" itself: "NEFF compilation failed
  with return code -N" (NEFFCompilationError, compiler_subprocess.py). A failed compile leaves no entry.
- Neuron 2.34's compiler-artifacts page: eager ops and compiled graphs share one job-based hierarchy under
  TORCH_NEURONX_DEBUG_DIR (default /tmp/neuron_backend): per graph its FX graph, its StableHLO, and the compile's
  own working dir. The page's opening names these steps, not the files: the fake's names (`job_<n>/fx_graph.txt`,
  `job_<n>/module.stablehlo.mlir`, `job_<n>/neuronx_cc/`) are its own. It writes them at the first meeting of a
  graph in the process (lowering) and at its compile; never into the host's own /tmp (only under FAKE_NEURON_TMP or
  a TORCH_NEURONX_DEBUG_DIR set). TORCH_NEURONX_HLO_CACHE_DIR (seen in user code of the native stack, unverified)
  receives `<sha256>.mlir` per lowered graph where it is set.
- The runtime's NeuronCores: NEURON_RT_VISIBLE_CORES (one index or an inclusive range), else NEURON_RT_NUM_CORES,
  else the host's (FAKE_NEURON_CORES, default 4); the platform target from the runtime (FAKE_NEURON_TARGET, default
  trn2). FAKE_NEURON_TMP stands in for /tmp; FAKE_NEURON_COMPILE_S makes a compile take that long, and
FAKE_NEURON_COMPILE_UNTIL until that file exists (holding the lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
import random
import string
import sys
import tempfile
import time
import types
import weakref
from importlib import metadata
from pathlib import Path


def _autoload() -> None:
    """The `torch.backends` entry point: `import torch` imports the package (pyproject.toml:14-15). Defined before
    this module imports torch, which loads the entry point again, as upstream's is."""


import torch  # noqa: E402  # after _autoload, which importing torch first looks up here

MODES = frozenset(m for m in os.environ.get("FAKE_NEURON", "").split(",") if m)
__version__ = metadata.version("torch-neuronx")
__shapeplan_fake__ = "shapeplan/testing/fake_site"  # what `doctor --report` names as the source of its answers

# _build_config.py and __init__.py:44-65: applied at import, with setdefault
RELEASE = "release_build" in MODES
IMPORT_DEFAULTS = {
    "JAX_LOGGING_LEVEL": "WARNING",
    "NEURON_LAUNCH_BLOCKING": "1" if RELEASE else "0",
    "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS": "0" if RELEASE else "1",
    "TORCH_NEURONX_MLIR_ATEN_OPS": "1",
    "TORCH_NEURONX_RETAIN_DEVICE_MODE": "0",
    "NEURON_RT_ALLOW_LEGACY_NEFF": "1",
    "NEURON_RT_DBG_ZEROCOPY": "1",
    "TORCH_NEURONX_ENABLE_ASYNC_NRT": "1",
    "TORCH_NEURONX_ENABLE_STACK_TRACE": "0",
}
for _name, _value in IMPORT_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

TMP = Path(os.environ.get("FAKE_NEURON_TMP") or "/tmp")
CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_PATH" if "renamed_cache_var" in MODES else "TORCH_NEURONX_NEFF_CACHE_DIR"

# The kernels built at import make sync mode's CompilerSubprocess, which creates the cache and lock dirs, unguarded
# (kernels/compiler_subprocess.py:89-97), and its CompilerConfig asks the runtime for the platform target
# (kernels/compiler_config.py:17 -> _C._get_platform_target -> nrt_get_instance_info, PlatformUtils.cpp:45-80): on a
# host without a Neuron instance the import itself fails.
# Those two dirs are the sync path's for the whole process: a variable set after `import torch` reaches only the
# C++ cache, which reads it at its first use (NeuronResourceManager.cpp:148-192).
SYNC_DIRS = (Path(os.environ.get(CACHE_VAR) or TMP / "neff_cache"),
             Path(os.environ.get("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR") or TMP / "local_cache"))
if "cache_failed" not in MODES:
    for _folder in SYNC_DIRS:
        os.makedirs(_folder, exist_ok=True)
if "no_instance" in MODES:
    raise RuntimeError("Failed to get Neuron instance information")
COUNTERS = {"in_memory_hits": "CompilationCache.InMemoryHits", "in_memory_misses": "CompilationCache.InMemoryMisses",
            "persistent_hits": "CompilationCache.PersistentHits",
            "persistent_misses": "CompilationCache.PersistentMisses",
            "total_compilations": "CompilationCache.TotalCompilations"}

counters: dict[str, int] = {}  # the metrics arena: counter name -> value, only bumped while metrics are enabled
memory: set[str] = set()  # sync mode's Python path: the keys met in this process
met: set[str] = set()  # the C++ cache's keys met in this process, compiled or still pending
entries: dict[str, dict[str, int]] = {}  # the C++ cache's in-process tier: key -> its entry, once compiled or loaded
pending: list[tuple[str, bool]] = []  # (key, graph) waiting for the compile thread
_state: dict[str, object] = {}  # what is read once: "metrics", "sync", "cache" (dir or None), "locks"


def metrics_enabled() -> bool:
    if "metrics" not in _state:
        value = os.environ.get("TORCH_NEURONX_METRICS_ENABLED", "")
        _state["metrics"] = value in ("1", "true", "TRUE", "yes", "YES") and "metrics_off" not in MODES
    return bool(_state["metrics"])


def set_metrics_enabled(enabled: bool) -> None:
    metrics_enabled()
    _state["metrics"] = bool(enabled) and "metrics_off" not in MODES


def _count(name: str) -> None:
    if metrics_enabled():
        counters[COUNTERS[name]] = counters.get(COUNTERS[name], 0) + 1


def _sync_mode() -> bool:
    if "sync" not in _state:
        _state["sync"] = os.environ.get("NEURON_LAUNCH_BLOCKING") == "1"
    return bool(_state["sync"])


def _cache() -> tuple[Path | None, Path]:
    """The persistent cache dir (None: it failed to start) and the lock dir, set up at the cache's first use."""
    if "locks" not in _state:
        cache = Path(os.environ.get(CACHE_VAR) or TMP / "neff_cache")
        try:
            if "cache_failed" in MODES:
                raise OSError("cannot create")
            cache.mkdir(parents=True, exist_ok=True)
        except OSError:
            print(f"WARNING: failed to create persistent cache directory {cache}, continuing without persistent "
                  "caching", file=sys.stderr)
            cache = None  # type: ignore[assignment]  # the cache that failed to start
        locks = Path(os.environ.get("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR") or TMP / "local_cache")
        try:
            locks.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            # CompilationCache.cpp:41-58: neither create-failure message names a lock
            raise RuntimeError(f"Failed to create local cache directory: path={locks} ({exc.strerror})") from None
        _state["cache"], _state["locks"] = cache, locks
    return _state["cache"], _state["locks"]  # type: ignore[return-value]  # set together above


def _locked(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        raise RuntimeError(f"Failed to open lock file {path}: {exc.strerror}") from None
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _readable(path: Path) -> bool:
    """PersistentCacheBackend::Get: a file of size <= 0 is a miss (PersistentCacheBackend.cpp:89-94)."""
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _cpp_cache_disabled() -> bool:
    """The C++ persistent tier is off when TORCH_NEURONX_NEFF_DISABLE_CACHE is exactly "1"
    (PersistentCacheBackend.cpp:55-59, IsEnvEnabled)."""
    return os.environ.get("TORCH_NEURONX_NEFF_DISABLE_CACHE") == "1"


def _python_cache_disabled() -> bool:
    """The sync path reads the same variable as 1/true/yes in any case (kernels/cache_utils.py:18-20)."""
    return os.environ.get("TORCH_NEURONX_NEFF_DISABLE_CACHE", "").lower() in ("1", "true", "yes")


def _in_process_cache_disabled() -> bool:
    """TORCH_NEURONX_DISABLE_NEFF_CACHE, 1/true/yes: the Python in-process tier is off, so every call compiles
    again (utils.py:191-198, is_neff_cache_disabled; docs/environment_variables.md: "forces recompilation")."""
    return os.environ.get("TORCH_NEURONX_DISABLE_NEFF_CACHE", "").lower() in ("1", "true", "yes")


def _write(path: Path, data: bytes, *, suffix: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix:  # the Python path's tempfile.NamedTemporaryFile(suffix=".tmp")
        fd, tmp = tempfile.mkstemp(suffix=suffix, dir=path.parent)
    else:  # the C++ path's mkstemp("<shard dir>/.tmp.XXXXXX") (PersistentCacheBackend.cpp:118-120)
        tmp = str(path.parent / f".tmp.{''.join(random.choices(string.ascii_letters, k=6))}")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _compile_delay() -> None:
    """A compile's duration: FAKE_NEURON_COMPILE_S seconds, or until the file FAKE_NEURON_COMPILE_UNTIL exists."""
    time.sleep(float(os.environ.get("FAKE_NEURON_COMPILE_S") or 0))
    until, deadline = os.environ.get("FAKE_NEURON_COMPILE_UNTIL"), time.monotonic() + 300
    while until and not Path(until).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


# The compiler arguments every C++ compile passes and keys with, before NEURON_CC_FLAGS (KernelExecution.cpp).
BASE_ARGS = "--model-type transformer --auto-cast=none"


def cache_key(key: str, *, graph: bool = False) -> str:
    """The C++ cache's key of the op (or compiled graph) whose own key is `key`, under the current settings:
    `<key>_<target>_<lnc>_<opt>_<args>` (KernelExecution.cpp CreateCompilerExtensionHash)."""
    target = os.environ.get("FAKE_NEURON_TARGET") or "trn2"
    lnc = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1" if target == "trn1" else "2")
    opt = os.environ.get("NEURON_COMPILER_OPT_LEVEL", "-O2" if graph else "-O1").removeprefix("-")
    args = BASE_ARGS + (f" {os.environ['NEURON_CC_FLAGS']}" if "NEURON_CC_FLAGS" in os.environ else "")
    return f"{key}_{target}_{lnc}_{opt}_{args.replace(' ', '_').replace('=', '-')}"


def neff_path(key: str, *, graph: bool = False) -> Path:
    """Where the C++ cache keeps the NEFF of the op whose own key is `key` (the fake's persistent key hashes the
    cache key alone: its IR is a function of the op's key)."""
    cache, _ = _cache()
    digest = hashlib.blake2b(cache_key(key, graph=graph).encode(), digest_size=16).hexdigest()
    return (cache or TMP / "neff_cache") / digest[:2] / digest[2:4] / f"{digest}.neff"


def kernel(key: str, *, graph: bool = False) -> None:
    """An op (or a `torch.compile` graph) meets the compile cache."""
    if _sync_mode() and not graph:
        _python_path(key)
        return
    full = cache_key(key, graph=graph)
    if full in met:  # compiled, loaded or pending: the pending compile's result serves it
        _count("in_memory_hits")
        if full in entries:
            entries[full]["access_count"] += 1
        return
    _count("in_memory_misses")
    met.add(full)
    _artifacts(key, graph)
    if "async" in MODES:
        pending.append((key, graph))
    else:
        _compile(key, graph)


class CompilationError(Exception):
    """kernels/compiler_subprocess.py's base of compile errors."""


class NEFFCompilationError(CompilationError):
    """Sync mode's failed neuronx-cc (kernels/compiler_subprocess.py run_neuronx_cc)."""


def _neuronx_cc(key: str, *, python_path: bool = False) -> bytes:
    """Run the "compiler" (its duration, its failure as FAKE_NEURON_COMPILER_EXIT says) and return the NEFF."""
    _compile_delay()
    code = os.environ.get("FAKE_NEURON_COMPILER_EXIT", "")
    if code and code != "0":
        if python_path:  # subprocess.run: a signal is -N
            raise NEFFCompilationError(f"NEFF compilation failed with return code {code}\nCommand: neuronx-cc compile "
                                       "module.hlo.pb ...\nError: ")
        if code.startswith("-"):  # WEXITSTATUS of a signalled child is 0: no error, and no NEFF either
            said = f"Failed to read compiled NEFF file: {tempfile.gettempdir()}/neuron_compile_Xq2a9/module.neff"
        else:
            said = f"Command failed (neuronx-cc compilation) with exit code {code}: "
        raise RuntimeError(f"HLO to NEFF compilation failed for op '{key}': {said}")
    return f"NEFF of {key}".encode()


def _compile(key: str, graph: bool) -> None:
    """The C++ CompilationCache: a persistent miss, then the lock and a second look before compiling."""
    cache, locks = _cache()
    full, path = cache_key(key, graph=graph), neff_path(key, graph=graph)
    if cache is not None and not _cpp_cache_disabled():
        if _readable(path):
            _count("persistent_hits")
            _entry(full, path.read_bytes(), 0)
            return
        _count("persistent_misses")
        fd = _locked(locks / "locks" / f"{path.stem}.lock")
        try:
            if _readable(path):  # another process wrote it while this one waited
                _count("persistent_hits")
                _entry(full, path.read_bytes(), 0)
                return
            neff = _timed_compile(full, key, graph)
            _write(path, neff)
        finally:
            os.close(fd)
        return
    _timed_compile(full, key, graph)


def _timed_compile(full: str, key: str, graph: bool) -> bytes:
    started = time.monotonic()
    try:
        neff = _neuronx_cc(key)
    except Exception:
        met.discard(full)  # HandleCompilationFailure: no entry, the next meeting compiles again
        raise
    _count("total_compilations")
    _entry(full, neff, max(1, round((time.monotonic() - started) * 1000)))
    _artifacts(key, graph, compiled=True)
    return neff


_JOB_NUMBERS = itertools.count()


def _entry(key: str, neff: bytes, milliseconds: int) -> None:
    entries[key] = {"neff_size_bytes": len(neff), "access_count": 0, "compilation_time_ms": milliseconds}


def _artifacts(key: str, graph: bool, *, compiled: bool = False) -> None:
    """What a graph leaves under TORCH_NEURONX_DEBUG_DIR when it is lowered, and when it is compiled (the fake's
    own file names), and its lowered module in TORCH_NEURONX_HLO_CACHE_DIR where that is set."""
    named = os.environ.get("TORCH_NEURONX_DEBUG_DIR")
    if named or os.environ.get("FAKE_NEURON_TMP"):  # never into the host's own /tmp
        jobs = _state.setdefault("jobs", {})  # this process's job per graph
        assert isinstance(jobs, dict)
        if key not in jobs:
            jobs[key] = f"job_{os.getpid()}_{next(_JOB_NUMBERS):05d}"
        job = Path(named or TMP / "neuron_backend") / jobs[key]
        if compiled:
            (job / "neuronx_cc").mkdir(parents=True, exist_ok=True)
            (job / "neuronx_cc" / "log-neuron-cc.txt").write_text("Compiler status PASS\n", encoding="utf-8")
        else:
            job.mkdir(parents=True, exist_ok=True)
            (job / "fx_graph.txt").write_text(f"{'graph' if graph else 'op'} {key}\n", encoding="utf-8")
            (job / "module.stablehlo.mlir").write_text(f"module @{key!r} {{}}\n", encoding="utf-8")
    hlo = os.environ.get("TORCH_NEURONX_HLO_CACHE_DIR")
    if hlo and not compiled:
        digest = hashlib.sha256(key.encode()).hexdigest()
        Path(hlo).mkdir(parents=True, exist_ok=True)
        (Path(hlo) / f"{digest}.mlir").write_text(f"module @{key!r} {{}}\n", encoding="utf-8")


def _python_path(key: str) -> None:
    """Sync mode's CompilerSubprocess: its own key, layout and locks, and no counters; its dirs as they were at
    import."""
    import neuronxcc

    started, _ = _cache()
    cache, locks = (SYNC_DIRS[0] if started is not None else None), SYNC_DIRS[1]
    if key in memory and not _in_process_cache_disabled():
        return
    memory.add(key)
    digest = hashlib.sha256(f"{key}|neuronxcc={neuronxcc.__version__}".encode()).hexdigest()
    path = (cache or TMP / "neff_cache") / digest / f"{digest}.neff"
    persistent = cache is not None and not _python_cache_disabled()
    if persistent and _readable(path):
        return
    fd = _locked(locks / digest / "locks" / "compile.lock")
    try:
        if persistent and _readable(path):
            return
        try:
            neff = _neuronx_cc(key, python_path=True)
        except NEFFCompilationError:
            memory.discard(key)
            raise
        if persistent:
            _write(path, neff, suffix=".tmp")
    finally:
        os.close(fd)


def synchronize(device: object = None) -> None:
    """Wait for the compile thread: what it compiled is counted and written now."""
    while pending:
        _compile(*pending.pop(0))


def restart() -> None:
    """A fresh process: the in-process tier, the counters and what is read once start empty (the disk stays)."""
    synchronize()
    memory.clear()
    met.clear()
    entries.clear()
    counters.clear()
    _state.clear()


def visible_cores() -> int:
    if "no_device" in MODES:
        return 0
    text = os.environ.get("NEURON_RT_VISIBLE_CORES", "")
    if text:
        first, _, last = text.partition("-")
        return int(last or first) - int(first) + 1
    host = int(os.environ.get("FAKE_NEURON_CORES") or 4)
    # NEURON_RT_NUM_CORES=0 is the runtime's default, "interpreted as all" (configuration-guide.rst:33-38); n is n
    # free cores the runtime picks (:128)
    return min(host, int(os.environ.get("NEURON_RT_NUM_CORES") or 0) or host)


def _stats() -> dict[str, float | int]:
    values = {key: counters.get(name, 0) for key, name in COUNTERS.items()}
    hits = values["in_memory_hits"] + values["persistent_hits"]
    misses = values["in_memory_misses"] + values["persistent_misses"]
    return {"total_entries": len(entries), **values, "cache_hits": hits, "cache_misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0, "memory_usage_bytes": 0,
            "total_compilation_time_ms": 0.0, "evictions_performed": 0, "max_cache_size_bytes": 1 << 30,
            "max_cache_entries": 10000, "memory_utilization_ratio": 0.0}


_C = types.ModuleType("torch_neuronx._C")
if "xla" not in MODES:
    _C._neuron_metrics_enabled = metrics_enabled  # type: ignore[attr-defined]  # the fake fills a bare module
    _C._neuron_set_metrics_enabled = set_metrics_enabled  # type: ignore[attr-defined]  # as above
    _C._neuron_counter_value = counters.get  # type: ignore[attr-defined]  # as above
    _C._neuron_counter_names = lambda: sorted(counters)  # type: ignore[attr-defined]  # as above
    _C._get_platform_target = lambda: os.environ.get("FAKE_NEURON_TARGET") or "trn2"  # type: ignore[attr-defined]  # as above
    _C._get_instance_type = lambda: f"{_C._get_platform_target()}.48xlarge"  # type: ignore[attr-defined]  # NeuronBindings.cpp:999-1001
    _C._get_logical_neuron_cores = lambda: os.environ.get(  # type: ignore[attr-defined]  # as above
        "NEURON_LOGICAL_NC_CONFIG", "1" if _C._get_platform_target() == "trn1" else "2")  # type: ignore[attr-defined]  # set above
if not MODES & {"no_stats", "xla"}:
    _C._get_compilation_cache_stats = _stats  # type: ignore[attr-defined]  # the fake fills a bare module
if not MODES & {"no_cache_entries", "xla"}:
    _C._get_compilation_cache_entries = lambda: [  # type: ignore[attr-defined]  # as above
        {"cache_key": key, **entry} for key, entry in entries.items()]
    _C._get_all_cache_keys = lambda: set(entries)  # type: ignore[attr-defined]  # as above

if "xla" not in MODES:
    neuron = types.ModuleType("torch.neuron")
    neuron.synchronize = synchronize  # type: ignore[attr-defined]  # the fake fills a bare module
    neuron.device_count = visible_cores  # type: ignore[attr-defined]  # the fake fills a bare module
    neuron.is_available = lambda: visible_cores() > 0  # type: ignore[attr-defined]  # as above
    neuron.current_device = lambda: 0  # type: ignore[attr-defined]  # as above
    neuron.set_device = lambda device: None  # type: ignore[attr-defined]  # as above
    neuron.get_device_properties = lambda device=None: types.SimpleNamespace(  # type: ignore[attr-defined]  # as above
        name="NeuronCore-v3", total_memory=24 * 1024 ** 3)
    neuron.get_amp_supported_dtype = lambda: [torch.bfloat16, torch.float16]  # type: ignore[attr-defined]  # as above
    neuron.is_bf16_supported = lambda: True  # type: ignore[attr-defined]  # as above
    neuron.manual_seed = neuron.manual_seed_all = lambda seed: None  # type: ignore[attr-defined]  # as above
    neuron._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]  # as above
    torch.neuron = neuron  # type: ignore[attr-defined]  # what the real backend registers, importable too
    sys.modules["torch.neuron"] = neuron


def _signature(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)}:{value.dtype}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_signature(v) for v in value) + "]"
    return type(value).__name__


def nki_flash_attention(args: tuple[object, ...], kwargs: dict[str, object]) -> bool:
    """Whether an SDPA call takes the NKI flash-attention kernel (scaled_dot_product_fused_attention.py:19-57)."""
    query, key = (*args[:2], None, None)[:2]
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == 4):
        return False
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    return (mask is None and not dropout and query.shape[-2] % 512 == 0 and key.shape[-2] % 512 == 0
            and query.shape[-1] <= 128)


if "device" in MODES:
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    if torch._C._get_privateuse1_backend_name() != "neuron":  # once per process (a test may import the fake again)
        # the device type the real backend registers in C++, with its hooks and device guard (accelerate, the
        # Trainer and dynamo ask them); tensors still live on the CPU
        from torch.utils.backend_registration import _DummyDeviceGuard, _DummyPrivateUse1Hook

        torch.utils.rename_privateuse1_backend("neuron")
        torch.utils.generate_methods_for_privateuse1_backend()
        torch._C._acc.register_python_privateuseone_hook(_DummyPrivateUse1Hook())
        torch._C._acc.register_python_privateuseone_device_guard(_DummyDeviceGuard())

    _in_graph = [False]
    # The tensors that live on the device (ids; each removed when its tensor dies): made with device="neuron", moved
    # there with `.to`, or computed from one that lives there. Ops on host tensors alone (a collator's, a loss
    # logged with `.item()`) are no kernels, as on the real device.
    _on_device: set[int] = set()
    _NEURON = torch.device("neuron", 0)
    _DEVICE_GET, _DATA_SET = torch.Tensor.device.__get__, torch.Tensor.data.__set__
    _TO_HOST = (torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item)

    def _is_device(value: object) -> bool:
        return isinstance(value, torch.Tensor) and id(value) in _on_device

    def _mark(value: object) -> None:
        if isinstance(value, torch.Tensor) and id(value) not in _on_device:
            _on_device.add(id(value))
            weakref.finalize(value, _on_device.discard, id(value))

    def _names_device(value: object) -> bool:
        return str(value).startswith("neuron")

    class _Device(TorchFunctionMode):
        """Every op runs on the CPU; outside a compiled graph each op on a device tensor with a tensor result is a
        kernel. A device tensor reports device neuron:0, so what code makes `device=t.device` lives there too."""

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # mirrors an untyped upstream signature
            kwargs = dict(kwargs or {})
            if torch.compiler.is_compiling():  # dynamo traces the mode: map the device, nothing it cannot trace
                if _names_device(kwargs.get("device", "")):
                    kwargs["device"] = "cpu"
                return func(*args, **kwargs)
            if func == _DEVICE_GET:
                return _NEURON if _is_device(args[0]) else func(*args, **kwargs)
            if func == _DATA_SET:  # `param.data = moved` (Module.to): the parameter now lives where `moved` does
                func(*args, **kwargs)
                if _is_device(args[1]):
                    _mark(args[0])
                return None
            if func in (torch.Tensor.pin_memory, torch.Tensor.is_pinned):  # host memory: no device hooks to ask
                return args[0] if func is torch.Tensor.pin_memory else False
            to_device = _names_device(kwargs.get("device", ""))
            if to_device:
                kwargs["device"] = "cpu"
            to_host = func in _TO_HOST or (func is torch.Tensor.to and str(args[1:2] and args[1]).startswith("cpu"))
            if func is torch.Tensor.to and args[1:2] and _names_device(args[1]):
                args, to_device = (args[0], "cpu", *args[2:]), True
            on_device = to_device or any(_is_device(t) for t in tree_flatten((args, kwargs))[0])
            result = func(*args, **kwargs)
            if to_host and _is_device(result):  # a host copy, which the CPU stand-in would hand back as is
                result = result.clone()
            if not on_device or to_host:  # a copy to the host is a transfer, not a kernel
                return result
            for value in tree_flatten(result)[0]:
                _mark(value)
            if isinstance(result, torch.Tensor) and not _in_graph[0] and not getattr(func, "__name__", "").startswith(
                    "__"):
                if func is torch.nn.functional.scaled_dot_product_attention and nki_flash_attention(args, kwargs):
                    tensor_info = tuple((t.shape, t.dtype) for t in args[:3] if isinstance(t, torch.Tensor))
                    kernel(f"nki_0_0_{hash(tensor_info)}")  # hash(torch.dtype) differs in every process
                else:
                    kernel(f"{getattr(func, '__name__', func)}{_signature(args)}")
            return result

    def _backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]  # mirrors an untyped upstream signature
        kernel("graph:" + gm.code + _signature(example_inputs), graph=True)

        def run(*args: torch.Tensor):  # type: ignore[no-untyped-def]  # mirrors an untyped upstream signature
            _in_graph[0] = True
            try:
                return gm.forward(*args)
            finally:
                _in_graph[0] = False

        return run

    torch._dynamo.register_backend(name="neuron")(_backend)
    _Device().__enter__()
