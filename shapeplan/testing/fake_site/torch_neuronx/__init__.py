"""A fake torch_neuronx (TorchNeuron, the native backend) for tests: the parts shapeplan reads, modelled on the
April 2026 source (research/neuron.md sections 2.1 and 8). Put shapeplan/testing/fake_site on sys.path
(in-process: shapeplan.testing.FakeNeuron; subprocesses: shapeplan.testing.fake_env) and choose its behaviour
with FAKE_NEURON, a comma list:

    device              torch calls on device "neuron" run on the CPU, each op (name + input shapes/dtypes) a
                        kernel of the compile cache; `torch.compile(backend="neuron")` graphs are kernels too
    async               compiles run on a background "thread": counters and files settle at synchronize()
    cache_failed        the persistent cache failed to start ("continuing without persistent caching"): nothing is
                        looked up or written and no persistent miss is counted; compiles still happen
    no_metrics          there is no torch_neuronx.metrics module
    no_stats            there is no _C._get_compilation_cache_stats
    metrics_off         the metrics stay off although TORCH_NEURONX_METRICS_ENABLED=1 (a release reading another name)
    xla                 an XLA-era package: no torch.neuron and no stats call
    renamed_cache_var   the cache dir is read from TORCH_NEURONX_NEFF_CACHE_PATH, not TORCH_NEURONX_NEFF_CACHE_DIR

A kernel the process has not met compiles unless the persistent cache holds it (a NEFF file `ab/cd/<32 hex>.neff`
in the cache dir, written through a `.tmp.XXXXXX` temporary and a rename).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import types
from importlib import metadata
from pathlib import Path

import torch

MODES = frozenset(m for m in os.environ.get("FAKE_NEURON", "").split(",") if m)
__version__ = metadata.version("torch-neuronx")
ENV_AT_IMPORT = {name: os.environ.get(name) for name in ("TORCH_NEURONX_NEFF_CACHE_DIR",
                                                         "TORCH_NEURONX_METRICS_ENABLED")}
METRICS_ENABLED = os.environ.get("TORCH_NEURONX_METRICS_ENABLED") == "1" and "metrics_off" not in MODES
CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_PATH" if "renamed_cache_var" in MODES else "TORCH_NEURONX_NEFF_CACHE_DIR"
CACHE_DIR = Path(os.environ.get(CACHE_VAR) or Path(tempfile.gettempdir()) / "neff_cache")
PERSISTENT = "cache_failed" not in MODES
# stats key -> metrics counter
METRICS = {"in_memory_hits": "CompilationCache.InMemoryHits", "in_memory_misses": "CompilationCache.InMemoryMisses",
           "persistent_hits": "CompilationCache.PersistentHits",
           "persistent_misses": "CompilationCache.PersistentMisses",
           "total_compilations": "CompilationCache.TotalCompilations"}

stats = dict.fromkeys(METRICS, 0)
counters: dict[str, int] = {}  # what torch_neuronx.metrics reports (only with TORCH_NEURONX_METRICS_ENABLED=1)
memory: set[str] = set()
pending: list[str] = []

if not PERSISTENT:
    print("WARNING: failed to initialize persistent cache, continuing without persistent caching", file=sys.stderr)


def _count(name: str) -> None:
    stats[name] += 1
    if METRICS_ENABLED:
        counters[METRICS[name]] = counters.get(METRICS[name], 0) + 1


def neff_path(key: str) -> Path:
    digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
    return CACHE_DIR / digest[:2] / digest[2:4] / f"{digest}.neff"


def kernel(key: str) -> None:
    """An op or graph meets the compile cache: the in-process tier, then (on the compile thread) the persistent one."""
    if key in memory:
        _count("in_memory_hits")
        return
    _count("in_memory_misses")
    memory.add(key)
    if "async" in MODES:
        pending.append(key)
    else:
        _compile(key)


def _compile(key: str) -> None:
    path = neff_path(key)
    if PERSISTENT and path.is_file():
        _count("persistent_hits")
        return
    _count("total_compilations")
    if PERSISTENT:
        _count("persistent_misses")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.tmp.", dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(key.encode())
        os.replace(tmp, path)


def synchronize(device: object = None) -> None:
    """Wait for the compile thread: what it compiled is counted and written now."""
    while pending:
        _compile(pending.pop(0))


def restart() -> None:
    """A fresh process: the in-process tier and the counters start empty (the persistent cache stays)."""
    synchronize()
    memory.clear()
    counters.clear()
    stats.update(dict.fromkeys(stats, 0))


_C = types.ModuleType("torch_neuronx._C")
if not MODES & {"no_stats", "xla"}:
    _C._get_compilation_cache_stats = lambda: dict(stats)  # type: ignore[attr-defined]  # the fake fills a bare module

if "xla" not in MODES:
    neuron = types.ModuleType("torch.neuron")
    neuron.synchronize = synchronize  # type: ignore[attr-defined]  # the fake fills a bare module
    neuron.is_available = lambda: True  # type: ignore[attr-defined]  # the fake fills a bare module
    torch.neuron = neuron  # type: ignore[attr-defined]  # what the real backend registers


def _signature(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)}:{value.dtype}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_signature(v) for v in value) + "]"
    return type(value).__name__


if "device" in MODES:
    from torch.overrides import TorchFunctionMode

    _in_graph = [False]

    class _Device(TorchFunctionMode):
        """Every op runs on the CPU; outside a compiled graph each op with a tensor result is a kernel."""

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # mirrors an untyped upstream signature
            kwargs = dict(kwargs or {})
            if str(kwargs.get("device", "")).startswith("neuron"):
                kwargs["device"] = "cpu"
            if func in (torch.Tensor.to,) and args[1:2] and str(args[1]).startswith("neuron"):
                args = (args[0], "cpu", *args[2:])
            result = func(*args, **kwargs)
            if (isinstance(result, torch.Tensor) and not _in_graph[0] and not torch.compiler.is_compiling()
                    and not getattr(func, "__name__", "").startswith("__")):
                kernel(f"{getattr(func, '__name__', func)}{_signature(args)}")
            return result

    def _backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):  # type: ignore[no-untyped-def]  # mirrors an untyped upstream signature
        kernel("graph:" + gm.code + _signature(example_inputs))

        def run(*args: torch.Tensor):  # type: ignore[no-untyped-def]  # mirrors an untyped upstream signature
            _in_graph[0] = True
            try:
                return gm.forward(*args)
            finally:
                _in_graph[0] = False

        return run

    torch._dynamo.register_backend(name="neuron")(_backend)
    _Device().__enter__()
