"""Compile backends: where compiled code is cached and how to count what compiled. `make_backend` picks one."""

from __future__ import annotations

import importlib.util

from ...errors import UsageError
from .base import Backend

DEVICES = ("neuron", "cuda", "cpu")


def default_device() -> str:
    """neuron where torch-neuronx is installed, else cuda where torch sees a GPU, else cpu."""
    if importlib.util.find_spec("torch_neuronx") is not None:
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
