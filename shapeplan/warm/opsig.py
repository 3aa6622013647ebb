"""ATen op signatures: what TorchNeuron's eager cache is keyed on (op, input shapes, dtypes, static arguments).

`OpRecorder` is a TorchDispatchMode that collects the signature of every op dispatched while it is active, so a
warm-up can be compared with a real run. Following torch-neuronx's `get_cache_key`, a float is a runtime value
(only its type counts); ints, bools, dtypes, devices and the like are static and count by value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Signature = tuple[Any, ...]


def _arg(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_arg(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _arg(v)) for k, v in value.items()))
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return "float"
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    return type(value).__name__


def signature(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Signature:
    return (str(func), _arg(args), _arg(kwargs))


class OpRecorder(TorchDispatchMode):
    """Collects op signatures while active; `paused()` leaves out what runs inside it (e.g. data loading)."""

    def __init__(self) -> None:
        super().__init__()
        self.signatures: set[Signature] = set()
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            self.signatures.add(signature(func, args, kwargs))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1


@contextlib.contextmanager
def outside_data_loading(recorder: OpRecorder) -> Iterator[None]:
    """Pause `recorder` while accelerate's data loaders produce a batch (sampler, collator, device copy) or start an
    epoch, and while datasets builds a streamed dataset's epoch counter (a shared-memory CPU tensor made at each
    step of the stream's pipeline and set at each epoch): the data pipeline runs on the host, not through the
    compiled model step."""
    import datasets.iterable_dataset as streams
    from accelerate.data_loader import DataLoaderShard

    original = DataLoaderShard.__iter__
    original_set_epoch = DataLoaderShard.set_epoch
    original_share = streams._maybe_share_with_torch_persistent_workers

    def paused_set_epoch(self, epoch: int) -> None:
        with recorder.paused():
            original_set_epoch(self, epoch)

    def paused_share(value: Any) -> Any:
        with recorder.paused():
            return original_share(value)

    def paused_iter(self):
        with recorder.paused():
            iterator = original(self)
        while True:
            with recorder.paused():
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
            yield batch

    DataLoaderShard.__iter__ = paused_iter
    DataLoaderShard.set_epoch = paused_set_epoch
    streams._maybe_share_with_torch_persistent_workers = paused_share
    try:
        yield
    finally:
        DataLoaderShard.__iter__ = original
        DataLoaderShard.set_epoch = original_set_epoch
        streams._maybe_share_with_torch_persistent_workers = original_share
