"""The device-op recorder of the coverage tests (tests/warm/placement.py) leaves the runs it records unchanged."""

from __future__ import annotations

import torch
from torch.utils._device import _device_constructors

from tests.conftest import TINY_MODEL
from tests.warm.placement import DeviceOpRecorder, tracking


def _load(architecture: type) -> dict[str, torch.Tensor]:
    from transformers import set_seed

    set_seed(0)
    model = architecture.from_pretrained(str(TINY_MODEL), dtype=torch.float32, device_map=None)
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_a_model_loaded_while_tracking_equals_one_loaded_without() -> None:
    """`tracking` wraps `torch.tensor`: a process whose first `torch.device(...)` context opens inside it (each rank of
    a 2-rank test) once left the weights a checkpoint lacks uninitialized (a reward model's `score` head, the rotary
    `inv_freq` buffers), which made those runs meet NaN now and then."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    for architecture in (AutoModelForSequenceClassification, AutoModelForCausalLM):
        _device_constructors.cache_clear()  # as in a fresh process
        with tracking(DeviceOpRecorder()):
            tracked = _load(architecture)
        untracked = _load(architecture)
        assert tracked.keys() == untracked.keys()
        assert [name for name, value in tracked.items() if not torch.equal(value, untracked[name])] == []
