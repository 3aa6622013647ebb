"""`shapeplan doctor`: what this host will warm with, then a self-test of its compile cache.

The self-test runs the same small work (one op and one `torch.compile` graph at a fresh shape) in two fresh
processes that share a temporary cache dir: the first must count a compile and write files, the second must load
from the cache and compile nothing. This is what `warm` and `verify` rely on; each failed check names its fix.
`python -m shapeplan.services.doctor DEVICE CACHE_DIR` is the self-test's child process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from ..adapters.host import usable_cores
from ..errors import ShapeplanError
from ..warm.backends.base import Backend, counter_delta
from ..warm.backends.neuron import DEFAULT_CACHE_DIR

PACKAGES = ("torch", "torch-neuronx", "neuronx-cc", "trl", "transformers", "accelerate", "datasets")
FILE_COUNTERS = ("neff_files",)  # counters that count files rather than compiles (the neuron backend's)
# Where a stack writes when it ignores the cache dir it was given: seen there, the variable was not read.
DEFAULT_DIRS = {"neuron": DEFAULT_CACHE_DIR}
SHAPE = (3, 37)  # the self-test's shape: new to a fresh cache dir
ATTENTION = (1, 2, 512, 64)  # an SDPA TorchNeuron runs with its NKI flash-attention kernel (seq % 512, head_dim <= 128)
CHILD_TIMEOUT_S = 1800  # one small op and one tiny graph; a first Neuron compile takes minutes

# How TorchNeuron says its lock dir or a lock file failed (CompilationCache.cpp:41-58, cache/FileLock.cpp:64-96;
# the create-failure messages name the local cache dir, not a lock).
LOCK_FAILURES = ("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "local cache directory", "lock directory", "lock file")
# What to do when a check fails, per compiler stack: (counters show no compile, no files, no hit, compiled again).
FIXES = {
    "neuron": {
        "counters": "torch-neuronx counted no compile: it did not read TORCH_NEURONX_METRICS_ENABLED=1 or reports "
                    "other counter names than the ones above; grep the installed torch_neuronx package for "
                    "METRICS_ENABLED and get_compilation_cache_stats",
        "files": "nothing was written into the cache dir: TorchNeuron could not create it (it printed 'continuing "
                 "without persistent caching' on stderr) or this torch-neuronx reads another variable than "
                 "TORCH_NEURONX_NEFF_CACHE_DIR (grep its package for NEFF_CACHE)",
        "hit": "the second process loaded nothing from the cache: the cache key differs between processes or the "
               "persistent cache is not read; check that NEURON_CC_FLAGS, NEURON_LOGICAL_NC_CONFIG and "
               "TORCH_NEURONX_* are the same in every process",
        "again": "the second process compiled again: the first one's NEFFs were not found; see the two lines above",
        "attention": "a known limitation of this torch-neuronx, not a fault of this host: its NKI flash-attention "
                     "kernel keys its cache with Python's hash() of the dtypes, which differs per process "
                     "(nki_op_impl.py), so an eager SDPA without a mask at a multiple of 512 tokens compiles again "
                     "in every run, warmed or not; `shapeplan analyze` lists those shapes; pad them "
                     "(pad_to_multiple_of), or pass --attn_implementation eager, or train with torch_compile "
                     "(where the attention is part of the graph's key)",
        "locks": "TorchNeuron's lock dir (TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR, default /tmp/local_cache) cannot be "
                 "created or written, so every compile fails: point it at a writable local folder",
        "disabled": "TorchNeuron's NEFF cache is turned off, so nothing is kept and `warm` refuses to run: unset "
                    "the variable(s) named",
    },
    "inductor": {
        "counters": "dynamo counted no FX-graph or AOTAutograd cache miss: the compile did not go through "
                    "Inductor's caches (TORCHINDUCTOR_FX_GRAPH_CACHE=0 or TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 set?)",
        "files": "nothing was written into the cache dir: Inductor did not read TORCHINDUCTOR_CACHE_DIR",
        "hit": "the second process loaded nothing from the cache: unset TORCHINDUCTOR_FORCE_DISABLE_CACHES and "
               "TORCHINDUCTOR_FX_GRAPH_CACHE=0",
        "again": "the second process compiled again: the first one's cache entries were not found",
    },
}


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    passed: bool
    detail: str  # what was seen
    fix: str = ""  # what to do, when it failed
    known: bool = False  # a failure that is the release's known limitation: reported, not failing the host
    warn: bool = False  # passed, with a cost worth knowing (its detail) and what avoids it (its fix)


@dataclass(frozen=True, slots=True)
class Diagnosis:
    versions: dict[str, str]
    device: str
    host: dict[str, str]  # OS, CPU and instance type, for a bug report
    cores: dict[str, Any]  # visible cores and how they were found
    cache_dir: str
    free_gib: float | None
    writable: bool
    settings: dict[str, str]  # what the compile cache key holds (the manifest's compiler environment)
    pad_to_multiple_of: str  # what TRL's "auto" resolves to on this device
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(check.passed or check.known for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "none"
    return out


def host() -> dict[str, str]:
    """The OS, CPU and EC2 instance type (as `accelerate env` lists them for a bug report)."""
    import platform

    from ..warm.backends.neuron import INSTANCE_TYPE_FILE

    try:
        instance = INSTANCE_TYPE_FILE.read_text(encoding="ascii").strip() or "unknown"
    except (OSError, UnicodeDecodeError):
        instance = "unknown (not an EC2 instance, or no DMI)"
    return {"os": platform.platform(),
            "cpu": f"{platform.machine()}, {usable_cores()} usable core(s) of {os.cpu_count()}",
            "instance type": instance}


def cores(device: str) -> dict[str, Any]:
    if device == "neuron":
        from ..warm.backends.neuron import requested_cores, visible_cores

        visible = visible_cores()
        named = ["NEURON_RT_VISIBLE_CORES"] if os.environ.get("NEURON_RT_VISIBLE_CORES") else \
            ["NEURON_RT_NUM_CORES"] if requested_cores() is not None else []  # NUM_CORES=0: all, the runtime's
        source = next(iter(named), "torch.neuron.device_count()" if "torch_neuronx" in sys.modules else "/dev/neuron*")
        return {"visible": visible, "count": len(visible) if visible is not None else None, "from": source}
    return {"visible": None, "count": usable_cores(), "from": "CPU affinity"}


def free_gib(path: Path) -> float | None:
    for folder in (path, *path.parents):
        if folder.exists():
            return round(shutil.disk_usage(folder).free / 1024 ** 3, 1)
    return None


def diagnose(device: str | None = None, cache_dir: Path | None = None) -> Diagnosis:
    """Everything `doctor` reports, self-test included."""
    from ..warm.backends import default_device, make_backend
    from ..warm.cachedir import check_cache_dir, default_cache_dir

    try:
        device = device or default_device()
    except RuntimeError as exc:  # `import torch` failed in its autoload of torch-neuronx: the neuron checks say why
        from ..warm.backends.neuron import autoload_failed

        if not autoload_failed(exc):
            raise
        device = "neuron"
    cache = cache_dir or default_cache_dir(device)
    checks: list[Check] = []
    try:
        check_cache_dir(cache)
        writable = True
        checks.append(Check("cache dir", True, f"{cache} is writable"))
    except ShapeplanError as exc:
        writable = False
        checks.append(Check("cache dir", False, f"{cache} is not writable", str(exc)))

    def diagnosis(found: list[Check], settings: dict[str, str] | None = None, pad: str = "unknown") -> Diagnosis:
        # before the stack loads (settings None), an unreadable core setting is a line, not a crash
        return Diagnosis(versions(), device, host(), cores(device) if settings is not None else _cores(device),
                         str(cache), free_gib(cache), writable, settings or {}, pad, tuple(found))

    try:
        backend = make_backend(device)
    except ShapeplanError as exc:  # e.g. the XLA-era package: nothing more can run
        return diagnosis([Check("compiler stack", False, f"--device {device} cannot run here", str(exc)), *checks])
    refused = _neuron_refusals() if backend.name == "neuron" else []
    if refused:  # the stack would not import, or would keep nothing: no self-test
        return diagnosis([*checks, *refused])
    if backend.name == "neuron":
        checks += sharing_checks(cache)
    try:
        settings = backend.settings()  # loads the stack: the core count below is then the runtime's own
    except ShapeplanError as exc:  # e.g. torch-neuronx that does not import on this host
        return diagnosis([Check("compiler stack", False, f"--device {device} does not load here", str(exc)), *checks])
    tested, pad = self_test(backend)
    return diagnosis([Check("compiler stack", True, f"{backend.name} on device {device}"), *checks, *tested],
                     settings, pad)


def _cores(device: str) -> dict[str, Any]:
    """The cores, or why they cannot be told (an unreadable core setting is that, not a crash of `doctor`)."""
    try:
        return cores(device)
    except ShapeplanError as exc:
        return {"visible": None, "count": None, "from": str(exc)}


def sharing_checks(cache: Path) -> list[Check]:
    """(Neuron) Whether one cache dir serves every rank (neither `cache` nor the environment's
    TORCH_NEURONX_NEFF_CACHE_DIR names a rank) and whether the cache and lock dirs are on local disk: warnings with
    their cost and fix, not failures."""
    from ..warm.backends.neuron import lock_dir, network_warnings, rank_warnings

    environment = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
    locks = lock_dir()
    out = []
    for name, found, fine in (
            ("one cache dir for every rank",
             rank_warnings(cache, environment=environment if environment != str(cache) else None),
             f"{cache}{f' and {environment}' if environment and environment != str(cache) else ''} name no rank"),
            ("cache and lock dirs on local disk", network_warnings(cache, locks),
             f"{cache} and {locks} are on no network file system")):
        out.append(Check(name, True, "; ".join(said for said, _ in found), "; ".join(fix for _, fix in found),
                         warn=True) if found else Check(name, True, fine))
    return out


def _neuron_refusals() -> list[Check]:
    """What fails before TorchNeuron's self-test could say anything: the NEFF cache turned off, a lock dir its
    import cannot create (CompilerSubprocess makes it at import, kernels/compiler_subprocess.py:89-97)."""
    from ..warm.backends.neuron import cache_disabled, lock_dir

    out = []
    disabled = cache_disabled()
    if disabled:
        out.append(Check("NEFF cache enabled", False, f"{' and '.join(disabled)} set", FIXES["neuron"]["disabled"]))
    locks = lock_dir()
    try:
        locks.mkdir(parents=True, exist_ok=True)  # what the import does anyway
        writable = os.access(locks, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        out.append(Check("lock dir", False, f"{locks} cannot be created or written", FIXES["neuron"]["locks"]))
    return out


def self_test(backend: Backend) -> tuple[list[Check], str]:
    """The self-test's checks, and TRL's `pad_to_multiple_of="auto"` as the first run resolved it."""
    fixes = FIXES[backend.name]
    fallback = DEFAULT_DIRS.get(backend.name)
    strays = _files(fallback) if fallback else set()
    with tempfile.TemporaryDirectory(prefix="shapeplan-doctor-") as folder:
        cache = Path(folder)
        first = _child(backend.device, cache, resolve_padding=True)
        if "error" in first:
            fix = fixes["locks"] if "locks" in fixes and any(m in first["error"] for m in LOCK_FAILURES) else \
                "fix the error above; `warm` would fail the same way"
            return [Check("first run", False, first["error"], fix)], "unknown"
        new_files = len(_files(cache))
        second = _child(backend.device, cache, resolve_padding=False)
        new_files2 = len(_files(cache)) - new_files
    checks = _first_checks(backend, first, new_files, fixes)
    if fallback and not new_files and _files(fallback) - strays:
        checks[-1] = replace(checks[-1], detail=f"{checks[-1].detail}; {len(_files(fallback) - strays)} new file(s) "
                             f"went to {fallback}, the default: the cache dir variable was not read")
    if "error" in second:
        return [*checks, Check("second run", False, second["error"], "fix the error above")], \
            first["pad_to_multiple_of"]
    delta = second["delta"]
    if second.get("attention") is not None:  # stacks whose eager ops compile: the attention kernel's own key
        # the self-test's cache dir is its own: a new NEFF there is this process's compile, counters or not
        recompiled = backend.compiled(second["attention"]) or second["attention"].get(FILE_COUNTERS[0], 0) > 0
        new_files2 -= second["attention"].get("neff_files", 0)
        checks.append(Check("second run loads SDPA at seq 512", not recompiled,
                            _shown(second["attention"], "counters moved: "), fixes["attention"] if recompiled else "",
                            known=recompiled))
        delta = counter_delta(second["attention"], delta)  # the checks below judge the rest of the work
    again = backend.compiled(delta) or new_files2 > 0
    checks += [
        Check("second run hits the cache", backend.hit(delta), _shown(delta, "counters moved: "),
              "" if backend.hit(delta) else fixes["hit"] if checks[0].passed else
              "the counters did not count the first run's compile either (see its line): fix that first"),
        Check("second run compiles nothing", not again,
              f"{_shown(delta, 'counters moved: ')}; {new_files2} new file(s)",
              fixes["again"] if again else ""),
    ]
    return checks, first["pad_to_multiple_of"]


def _first_checks(backend: Backend, result: Mapping[str, Any], new_files: int,
                  fixes: Mapping[str, str]) -> list[Check]:
    delta = result["delta"]
    counted = backend.compiled({k: v for k, v in delta.items() if k not in FILE_COUNTERS})
    sources = result.get("sources")
    read = f"read from {', '.join(k for k, v in sources.items() if v)}; " if sources else ""
    return [
        Check("first run counts a compile", counted, f"{read}{_shown(delta, 'counters moved: ')}",
              "" if counted else fixes["counters"]),
        Check("first run writes cache files", new_files > 0, f"{new_files} new file(s) in the cache dir",
              "" if new_files else fixes["files"]),
    ]


def _shown(delta: Mapping[str, int], prefix: str) -> str:
    return prefix + (" ".join(f"{k}={v:+d}" for k, v in sorted(delta.items())) or "none")


def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else set()


def _child(device: str, cache: Path, *, resolve_padding: bool) -> dict[str, Any]:
    """One self-test run in a fresh process: its counter changes, or the error it ended with."""
    pad = ["pad"] if resolve_padding else []
    command = [sys.executable, "-m", "shapeplan.services.doctor", device, str(cache), *pad]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"the self-test did not finish in {CHILD_TIMEOUT_S} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the self-test process exited with code {done.returncode}: {last}"}
    return json.loads(lines[-1])


def child(device: str, cache: Path, *, resolve_padding: bool) -> dict[str, Any]:
    """The self-test's work in this (fresh) process: one op and one tiny `torch.compile` graph on `device`, then the
    counters after synchronizing (the backend's `counters` does); and TRL's padding if asked."""
    from ..warm.backends import make_backend

    backend = make_backend(device)
    backend.prepare(cache)
    import torch

    backend.configure(torch_compile=True, graphs=1)
    start = backend.counters()
    attention = None
    if device == "neuron":  # eager ops compile there: an SDPA that takes the NKI flash-attention kernel, alone
        q = torch.ones(ATTENTION, dtype=torch.float32, device=device)
        float(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().cpu())
        attention = counter_delta(start, backend.counters())
    x = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32, device=device).reshape(SHAPE)
    product = x @ x.T
    # a graph Inductor lowers to an extern matmul: its caches are exercised without a minute of C++ compile
    graph = torch.compile(lambda t: t @ t.T, backend=backend.name, dynamic=False)
    float((product.sum() + graph(x).sum()).cpu())  # waits for the device
    delta = counter_delta(start, backend.counters())
    sources = getattr(backend, "sources", None)  # the neuron backend's: which counter APIs exist
    return {"delta": delta, "attention": attention, "sources": sources() if sources else None,
            "pad_to_multiple_of": _trl_auto_padding(device) if resolve_padding else None}


def _trl_auto_padding(device: str) -> str:
    """What TRL's own config resolves `pad_to_multiple_of="auto"` to on `device` (SFTConfig.__post_init__)."""
    try:
        from trl import SFTConfig

        with tempfile.TemporaryDirectory() as out:
            resolved = SFTConfig(output_dir=out, use_cpu=device == "cpu", report_to="none").pad_to_multiple_of
    except (ImportError, AttributeError, RuntimeError, TypeError, ValueError) as exc:  # reported, not fatal
        return f"unknown ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return str(resolved)


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], Path(sys.argv[2]), resolve_padding=sys.argv[3:] == ["pad"])))
