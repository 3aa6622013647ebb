"""TorchNeuron (torch-neuronx >= 2.13, Trn2/Trn3): NEFFs for eager ops and `torch.compile(backend="neuron")`
graphs go to TORCH_NEURONX_NEFF_CACHE_DIR; compile counters need TORCH_NEURONX_METRICS_ENABLED=1.

torch-neuronx is imported lazily, and only after `prepare`: PyTorch autoloads the backend at `import torch`, and
the backend reads its environment variables then.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

from ...errors import UsageError
from ...host import installed_versions

# Counters of `torch_neuronx.metrics` (neuron.md section 4), read as totals of this process.
METRIC_COUNTERS = (
    "CompilationCache.PersistentHits",
    "CompilationCache.PersistentMisses",
    "CompilationCache.TotalCompilations",
)
# Settings that are part of the NEFF cache key: they must be equal in warm-up and training.
KEY_ENV = ("NEURON_CC_FLAGS", "NEURON_LOGICAL_NC_CONFIG", "NEURON_COMPILER_OPT_LEVEL")
MISSING = ("--device neuron needs torch-neuronx, which is not installed; run `pip install shapeplan[neuron]` on a "
           "Trainium (Trn2/Trn3) host with the Neuron SDK, or pass --device cpu")


def require_torch_neuronx() -> None:
    if importlib.util.find_spec("torch_neuronx") is None:
        raise UsageError(MISSING)


class NeuronBackend:
    name = "neuron"
    device = "neuron"

    def __init__(self) -> None:
        require_torch_neuronx()

    def prepare(self, cache_dir: Path) -> None:
        os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(cache_dir)
        os.environ["TORCH_NEURONX_METRICS_ENABLED"] = "1"

    def configure(self, *, torch_compile: bool, graphs: int) -> None:
        if torch_compile:
            from .inductor import apply_dynamo_settings

            apply_dynamo_settings(graphs)

    def _module(self):  # type: ignore[no-untyped-def]
        return importlib.import_module("torch_neuronx")

    def counters(self) -> dict[str, int]:
        neuronx = self._module()
        out: dict[str, int] = {}
        stats = neuronx._C._get_compilation_cache_stats()
        for name, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[str(name)] = int(value)
        metrics = getattr(neuronx, "metrics", None)
        if metrics is not None:
            for name in METRIC_COUNTERS:
                out[name] = int(metrics.get_counter_value(name) or 0)
        return out

    def compiled(self, delta: Mapping[str, int]) -> bool:
        return any(delta.get(name, 0) > 0 for name in
                   ("persistent_misses", "CompilationCache.PersistentMisses", "CompilationCache.TotalCompilations"))

    def settings(self) -> dict[str, str]:
        out = {"backend": "neuron", "device": "neuron"}
        for name, version in installed_versions(("torch", "torch-neuronx", "neuronx-cc")).items():
            if version is None:
                version = getattr(self._module(), "__version__", "unknown") if name == "torch-neuronx" else "none"
            out[name] = version
        for name in (*KEY_ENV, *sorted(k for k in os.environ if k.startswith("TORCH_NEURONX_ENABLE_"))):
            out[name] = os.environ.get(name, "")
        return out

    def script_lines(self, cache_dir: Path, *, torch_compile: bool, graphs: int) -> tuple[str, ...]:
        lines = [f"export TORCH_NEURONX_NEFF_CACHE_DIR={cache_dir}"]
        lines += [f"export {name}={os.environ[name]}" for name in KEY_ENV if os.environ.get(name)]
        if torch_compile:
            from .inductor import dynamo_settings

            lines += [f"torch._dynamo.config.{name} = {value!r}" for name, value in dynamo_settings(graphs).items()]
        return tuple(lines)
