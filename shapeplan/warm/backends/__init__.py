"""Compile backends: where compiled code is cached and how to count what compiled. `make_backend` picks one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from ...errors import UsageError
from .base import Backend

DEVICES = ("neuron", "cuda", "cpu")


def default_device() -> str:
    """neuron where TorchNeuron sees a NeuronCore (`torch.neuron.is_available()`, as transformers and accelerate
    decide), else cuda where torch sees a GPU, else cpu."""
    if importlib.util.find_spec("torch_neuronx") is not None and _neuron_available():
        return "neuron"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def make_backend(device: str) -> Backend:
    if device == "neuron":
        from .neuron import NeuronBackend

        return NeuronBackend()
    if device in ("cpu", "cuda"):
        from .inductor import InductorBackend

        return InductorBackend(device)
    raise UsageError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")


def _neuron_available() -> bool:
    """`torch.neuron.is_available()`, asked in a child process: this one sets TorchNeuron's variables before it
    loads."""
    probe = "import torch, sys; sys.exit(0 if getattr(torch, 'neuron', None) and torch.neuron.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300,
                              check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False
