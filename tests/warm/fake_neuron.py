"""FakeNeuron: a test double of the `torch_neuronx` module, as much of it as shapeplan reads (neuron.md section 4).

    fake = FakeNeuron().install(monkeypatch)   # sys.modules["torch_neuronx"], found by importlib.util.find_spec
    fake.compile(2); fake.hit(3)               # what a compile / a persistent-cache hit does to the counters

It mimics `torch_neuronx._C._get_compilation_cache_stats()` (a dict with persistent_hits/persistent_misses/...),
`torch_neuronx.metrics.get_counter_value(name)` (None for a counter never bumped, as upstream returns), and
reads the environment variables the real backend reads at import (`env_at_import`).
"""

from __future__ import annotations

import importlib.machinery
import os
import types

import pytest

ENV = ("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_METRICS_ENABLED")


class FakeNeuron:
    version = "2.13.3.0"

    def __init__(self) -> None:
        self.stats = {"in_memory_hits": 0, "in_memory_misses": 0, "persistent_hits": 0, "persistent_misses": 0}
        self.metrics: dict[str, int] = {}
        self.env_at_import: dict[str, str | None] = {}

    def compile(self, n: int = 1) -> None:
        self.stats["persistent_misses"] += n
        self._bump("CompilationCache.PersistentMisses", n)
        self._bump("CompilationCache.TotalCompilations", n)

    def hit(self, n: int = 1) -> None:
        self.stats["persistent_hits"] += n
        self._bump("CompilationCache.PersistentHits", n)

    def _bump(self, name: str, n: int) -> None:
        if os.environ.get("TORCH_NEURONX_METRICS_ENABLED") == "1":
            self.metrics[name] = self.metrics.get(name, 0) + n

    def module(self) -> types.ModuleType:
        module = types.ModuleType("torch_neuronx")
        module.__spec__ = importlib.machinery.ModuleSpec("torch_neuronx", None)
        module.__version__ = self.version
        c = types.ModuleType("torch_neuronx._C")
        c._get_compilation_cache_stats = lambda: dict(self.stats)
        metrics = types.ModuleType("torch_neuronx.metrics")
        metrics.get_counter_value = lambda name: self.metrics.get(name)
        module._C = c
        module.metrics = metrics
        self.env_at_import = {name: os.environ.get(name) for name in ENV}
        return module

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeNeuron:
        """Make `import torch_neuronx` return the fake (imported lazily, as the real one is)."""
        import sys

        class Finder:
            @staticmethod
            def find_spec(name, path=None, target=None):  # type: ignore[no-untyped-def]
                if name != "torch_neuronx":
                    return None
                return importlib.machinery.ModuleSpec(name, Loader())

        class Loader:
            @staticmethod
            def create_module(spec):  # type: ignore[no-untyped-def]
                return fake.module()

            @staticmethod
            def exec_module(module):  # type: ignore[no-untyped-def]
                return None

        fake = self
        monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
        monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
        for name in ENV:
            monkeypatch.delenv(name, raising=False)
        return self
