"""FakeNeuron: puts the fake torch_neuronx of `SITE` (shapeplan/testing/fake_site) on this process's path
(subprocesses get it from `fake_env`), in the modes its docstring lists.

    fake = FakeNeuron("async").install(monkeypatch)   # found by importlib.util.find_spec, imported lazily
    fake.kernel("matmul 2x128")                        # an op meets the compile cache (after the backend imported it)
    fake.restart()                                     # a fresh process: the in-process tier is empty again
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

# A plain folder, not a package: put on sys.path (or PYTHONPATH) it makes `import torch_neuronx` find the fake.
SITE = Path(__file__).resolve().parent / "fake_site"
VERSION = "2.13.3.0"
# What the fake's import (its defaults, as upstream's __init__ sets them) and the backend set in os.environ.
ENV_SET = ("JAX_LOGGING_LEVEL", "NEURON_LAUNCH_BLOCKING", "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS",
           "TORCH_NEURONX_MLIR_ATEN_OPS", "TORCH_NEURONX_RETAIN_DEVICE_MODE", "NEURON_RT_ALLOW_LEGACY_NEFF",
           "NEURON_RT_DBG_ZEROCOPY", "TORCH_NEURONX_ENABLE_ASYNC_NRT", "TORCH_NEURONX_ENABLE_STACK_TRACE",
           "TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "TORCH_NEURONX_METRICS_ENABLED")


def fake_env(*modes: str, site: Path = SITE, **extra: str) -> dict[str, str]:
    """The environment of a subprocess that imports the fake (with the root shapeplan is imported from on
    PYTHONPATH too)."""
    root = SITE.parent.parent.parent
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(site), str(SITE), str(root)])),
            "FAKE_NEURON": ",".join(modes), **extra}


def version_site(folder: Path, version: str) -> Path:
    """A site folder whose torch-neuronx metadata says `version` (e.g. "2.13.3.1", Neuron 2.34's build); put it
    before the fake's, and the fake reports that version."""
    info = folder / f"torch_neuronx-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch-neuronx\nVersion: {version}\n",
                                   encoding="ascii")
    return folder


def xla_site(folder: Path) -> Path:
    """A site folder whose torch-neuronx metadata says 2.9.0 (the XLA era); put it before the fake's."""
    return version_site(folder, "2.9.0")


class FakeNeuron:
    version = VERSION

    def __init__(self, *modes: str) -> None:
        self.modes = modes

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeNeuron:
        """Make the fake importable; everything it touches (sys.modules, torch.neuron, env) is undone after the
        test."""
        import torch  # here, not at import: the other fakes of shapeplan.testing need no torch

        monkeypatch.syspath_prepend(str(SITE))
        # child processes (the default device's probe) find it too, and `import torch` there autoloads it
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")])))
        monkeypatch.setenv("FAKE_NEURON", ",".join(self.modes))
        # the fake's stand-in for /tmp (its default cache and lock dirs): not the host's
        monkeypatch.setenv("FAKE_NEURON_TMP", tempfile.mkdtemp(prefix="fake-neuron-tmp-"))
        for name in ENV_SET:
            monkeypatch.setenv(name, "")  # undone last: restores them as they were before the test
            monkeypatch.delenv(name)
        for name in ("torch_neuronx", "torch_neuronx.metrics", "torch.neuron", "neuronxcc"):
            monkeypatch.setitem(sys.modules, name, None)  # undone last: restores "not imported"
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setattr(torch, "neuron", None, raising=False)
        monkeypatch.delattr(torch, "neuron")
        return self

    @property
    def module(self) -> ModuleType:
        return importlib.import_module("torch_neuronx")

    def kernel(self, key: str) -> None:
        self.module.kernel(key)

    def restart(self) -> None:
        self.module.restart()
