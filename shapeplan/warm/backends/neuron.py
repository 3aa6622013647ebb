"""TorchNeuron (torch-neuronx >= 2.13, Trn2/Trn3): NEFFs for eager ops and `torch.compile(backend="neuron")`
graphs go to TORCH_NEURONX_NEFF_CACHE_DIR; compile counters need TORCH_NEURONX_METRICS_ENABLED=1.

torch-neuronx is imported lazily, and only after `prepare`: PyTorch autoloads the backend at `import torch`, and
the backend reads its environment variables then. Compiles run on the backend's own thread, so every counter read
synchronizes first; and because a persistent cache that failed to start counts no miss and writes nothing, a shape
counts as compiled when any compile counter moves or new NEFF files appear (research/neuron.md section 8).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import CacheError, UsageError
from ...host import installed_versions

# The `torch_neuronx.metrics` counters read (totals of this process); with the private
# `_C._get_compilation_cache_stats()` dict's keys, the names that mean a compile or a persistent-cache hit.
METRIC_COUNTERS = (
    "CompilationCache.PersistentHits",
    "CompilationCache.PersistentMisses",
    "CompilationCache.TotalCompilations",
)
COMPILES = ("persistent_misses", "total_compilations", "CompilationCache.PersistentMisses",
            "CompilationCache.TotalCompilations", "neff_files")
HITS = ("persistent_hits", "CompilationCache.PersistentHits")
# Settings in the NEFF cache key besides the platform target (KernelExecution.cpp): equal in warm-up and training.
KEY_ENV = ("NEURON_CC_FLAGS", "NEURON_LOGICAL_NC_CONFIG", "NEURON_COMPILER_OPT_LEVEL")
# TORCH_NEURONX_* variables that only say where things go or how much is logged; every other one may change
# the compiled code (e.g. TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS, TORCH_NEURONX_ENABLE_*).
NOT_CODE = ("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "TORCH_NEURONX_METRICS_ENABLED",
            "TORCH_NEURONX_LOG_LEVEL", "TORCH_NEURONX_LOG_FILE", "TORCH_NEURONX_DEBUG_DIR",
            "TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT", "TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS")
# The logical-core config each platform defaults to when NEURON_LOGICAL_NC_CONFIG is unset (PlatformUtils.cpp).
DEFAULT_LNC = {"trn2": "2", "trn3": "2", "trn1": "1"}
# Physical NeuronCores per Neuron device (/dev/neuronN).
CORES_PER_DEVICE = {"trn2": 8, "trn3": 8}
# Where EC2 (Nitro) exposes the instance type.
# Where TorchNeuron writes NEFFs when it finds no cache dir setting of its own (/tmp/neff_cache unless TMPDIR is set).
DEFAULT_CACHE_DIR = Path(tempfile.gettempdir()) / "neff_cache"
INSTANCE_TYPE_FILE = Path("/sys/devices/virtual/dmi/id/product_name")
DEVICE_DIR = Path("/dev")
TARGET_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
FIRST_NATIVE = (2, 13)
MISSING = ("--device neuron needs torch-neuronx, which is not installed; run `pip install shapeplan[neuron]` on a "
           "Trainium (Trn2/Trn3) host with the Neuron SDK, or pass --device cpu")
NATIVE = ("TorchNeuron: torch-neuronx >= 2.13 on a Trn2/Trn3 host, Python >= 3.12, installed from the Neuron pip "
          "index; or pass --device cpu")


def platform_target() -> str:
    """trn2 / trn3 / trn1 from $NEURON_PLATFORM_TARGET_OVERRIDE or the instance type; "unknown" off EC2."""
    if os.environ.get(TARGET_ENV):
        return os.environ[TARGET_ENV]
    try:
        instance = INSTANCE_TYPE_FILE.read_text(encoding="ascii").strip()
    except OSError:
        return "unknown"
    family = instance.split(".")[0]
    if family.startswith(("trn1", "inf2")):
        return "trn1"
    return family[:4] if family.startswith(("trn2", "trn3")) else "unknown"


def logical_nc_config(target: str) -> str:
    """NEURON_LOGICAL_NC_CONFIG as the compiler sees it: unset means the platform default."""
    return os.environ.get("NEURON_LOGICAL_NC_CONFIG") or DEFAULT_LNC.get(target, "default")


def parse_cores(text: str) -> list[int]:
    """NEURON_RT_VISIBLE_CORES ("3", "4-7", "0,1,2,3") as a sorted list of core ids."""
    cores: set[int] = set()
    try:
        for item in text.replace(" ", "").split(","):
            first, _, last = item.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise UsageError(f"NEURON_RT_VISIBLE_CORES={text!r} is not a core list; use e.g. 0-3 or 0,1,2,3") from None
    return sorted(cores)


def visible_cores() -> list[int] | None:
    """The logical NeuronCores this process may use: $NEURON_RT_VISIBLE_CORES, else every core of the host's
    Neuron devices at its logical-core config; None where that cannot be told (no /dev/neuron*, unknown platform)."""
    if os.environ.get("NEURON_RT_VISIBLE_CORES"):
        return parse_cores(os.environ["NEURON_RT_VISIBLE_CORES"])
    target = platform_target()
    lnc = logical_nc_config(target)
    devices = [p for p in DEVICE_DIR.glob("neuron*") if p.name[6:].isdigit()]
    if not devices or target not in CORES_PER_DEVICE or not lnc.isdigit():
        return None
    return list(range(len(devices) * CORES_PER_DEVICE[target] // int(lnc)))


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
    if platform_target() == "trn1":
        raise UsageError(f"this is a Trn1/Inf2 host, which TorchNeuron does not support; use {NATIVE}")


def count_neffs(cache_dir: Path) -> int:
    """NEFF files in the cache (both layouts: ab/cd/<key>.neff and <sha>/<sha>.neff); temporaries end otherwise."""
    return sum(1 for _ in cache_dir.rglob("*.neff"))


class NeuronBackend:
    name = "neuron"
    device = "neuron"

    def __init__(self) -> None:
        require_torch_neuronx()
        self.cache_dir: Path | None = None

    def prepare(self, cache_dir: Path, *, scratch: Path | None = None) -> None:
        self.cache_dir = cache_dir
        os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(cache_dir)
        if scratch is not None:  # compile locks go to a local dir that must be writable (neuron.md 2.1)
            os.environ["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"] = str(scratch / "locks")
        os.environ["TORCH_NEURONX_METRICS_ENABLED"] = "1"

    def configure(self, *, torch_compile: bool, graphs: int) -> None:
        if torch_compile:
            from .inductor import apply_dynamo_settings

            apply_dynamo_settings(graphs)

    def compiles(self, *, torch_compile: bool) -> bool:
        return True  # every graph the device runs is compiled, eager or not

    def _module(self) -> Any:
        module = importlib.import_module("torch_neuronx")
        import torch

        if getattr(torch, "neuron", None) is None:  # the XLA-era package registers no `neuron` device
            raise UsageError(f"torch-neuronx {getattr(module, '__version__', '')} has no torch.neuron device (the "
                             f"PyTorch/XLA stack); use {NATIVE}")
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
            for name, value in module._C._get_compilation_cache_stats().items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[str(name)] = int(value)
        if sources["torch_neuronx.metrics"]:
            metrics = importlib.import_module("torch_neuronx.metrics")
            for name in METRIC_COUNTERS:
                out[name] = int(metrics.get_counter_value(name) or 0)
        if not any(sources.values()):
            raise CacheError(f"torch-neuronx {module.__version__} has neither _C._get_compilation_cache_stats nor "
                             "torch_neuronx.metrics, so compiles cannot be counted; use a TorchNeuron release that "
                             "has one (2.13/2.14)")
        if self.cache_dir is not None:
            out["neff_files"] = count_neffs(self.cache_dir)
        return out

    def compiled(self, delta: Mapping[str, int]) -> bool:
        return any(delta.get(name, 0) > 0 for name in COMPILES)

    def hit(self, delta: Mapping[str, int]) -> bool:
        return any(delta.get(name, 0) > 0 for name in HITS)

    def settings(self) -> dict[str, str]:
        """Versions, platform target and every code-changing setting, normalized so that settings the compiler
        sees as equal (NEURON_LOGICAL_NC_CONFIG unset or the platform default) read equal."""
        target = platform_target()
        out = {"backend": "neuron", "device": "neuron", "target": target}
        out.update((name, version or "none")
                   for name, version in installed_versions(("torch", "torch-neuronx", "neuronx-cc")).items())
        out["NEURON_CC_FLAGS"] = os.environ.get("NEURON_CC_FLAGS", "")
        out["NEURON_LOGICAL_NC_CONFIG"] = logical_nc_config(target)
        out["NEURON_COMPILER_OPT_LEVEL"] = os.environ.get("NEURON_COMPILER_OPT_LEVEL") or "default"
        out.update((name, os.environ[name]) for name in code_settings())
        return out

    def script_lines(self, cache_dir: Path, *, torch_compile: bool, graphs: int) -> tuple[str, ...]:
        lines = [f"export TORCH_NEURONX_NEFF_CACHE_DIR={cache_dir}"]
        lines += [f"export {name}={os.environ[name]}" for name in (*KEY_ENV, *code_settings()) if os.environ.get(name)]
        if torch_compile:
            from .inductor import dynamo_settings

            lines += [f"torch._dynamo.config.{name} = {value!r}" for name, value in dynamo_settings(graphs).items()]
        return tuple(lines)


def code_settings() -> list[str]:
    """The set TORCH_NEURONX_* variables that may change compiled code, sorted."""
    return sorted(k for k in os.environ if k.startswith("TORCH_NEURONX_") and k not in NOT_CODE and os.environ[k])
