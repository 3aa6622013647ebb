"""Device-op signatures on CPU: which ATen ops of a run would execute on the accelerator.

On Neuron a tensor lives either on the host (CPU) or on the device; only ops on device tensors are compiled (NEFFs
keyed on their signatures), while ops on host tensors run on the CPU and compile nothing. On a CPU-only test box
both kinds run on the same CPU, so `DeviceOpRecorder` tracks where each tensor would live instead:

- host tensors are made from Python data without a device (`torch.tensor(list)`, an index list) or by the data
  loader (its sampler's permutations, the collator), and everything computed only from host tensors: TRL's `pad()`
  (which allocates its output on `tensors[0].device`, the host), `ones_like` of a
  host tensor, per-row slicing of a `.cpu()` copy;
- a tensor becomes a device tensor when it is moved with `.to(device)` (or `torch.tensor(..., device=...)`);
  factory ops (`arange`, `full`, ... called with a device) create device tensors, and tensors the recorder never
  saw made (model parameters, optimizer state) are device tensors; `.cpu()` makes a host copy.

An op is a device op when any tensor it reads is a device tensor, or when it is a factory op outside TRL's `pad`.
The ops of `torch.distributed.all_gather_object` (a pickled Python object in a byte tensor, as long as the pickle:
TRL's ranks gather their prompt and completion texts for the logs) are kept apart, in `objects`: their sizes are
those of the run's texts, which a warm-up on synthetic prompts does not have.
Host work (tokenizing, building and padding prompt/completion ids and masks from Python lists) is what differs
between two runs whose prompts differ but fall in the same buckets; the device ops of such runs are equal
(tests/warm/test_grpo_opsig.py checks that).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shapeplan.warm.opsig import Signature, outside_data_loading, signature


class DeviceOpRecorder(TorchDispatchMode):
    """Collects the signatures of device ops (see the module docstring) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.signatures: set[Signature] = set()  # device ops
        self.everything: set[Signature] = set()  # every op, host ones included
        self.objects: set[Signature] = set()  # the ops of object gathers (see the module docstring)
        self._objects = 0  # inside an object gather
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> tensor (tensors compare elementwise)
        self._host_region = 0  # inside TRL's pad(): everything is host work
        self._made_on: str | None = None  # inside torch.tensor(...): where the new tensor lives

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.everything.add(signature(func, args, kwargs))
        if self._made_on is not None:  # torch.tensor(data): made on the host, or copied to the device; no compile
            for t in _tensors(out):
                self.mark(t, host=self._made_on == "host")
            return out
        inputs = _tensors((args, kwargs))
        if func is torch.ops.aten.lift_fresh.default:  # Python data made a tensor (`host[list]`): made on the host
            self.mark(out, host=True)
            return out
        if self._host_region or (inputs and all(self.on_host(t) for t in inputs)):
            for t in _tensors(out):
                self.mark(t, host=True)
        else:
            (self.objects if self._objects else self.signatures).add(signature(func, args, kwargs))
        return out

    def on_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def mark(self, tensor: Any, *, host: bool) -> None:
        if isinstance(tensor, torch.Tensor):
            if host:
                self._host[id(tensor)] = weakref.ref(tensor)
            else:
                self._host.pop(id(tensor), None)

    @contextlib.contextmanager
    def host_region(self) -> Iterator[None]:
        self._host_region += 1
        try:
            yield
        finally:
            self._host_region -= 1

    paused = host_region  # what `outside_data_loading` calls: the data pipeline runs on the host

    @contextlib.contextmanager
    def object_gather(self) -> Iterator[None]:
        self._objects += 1
        try:
            yield
        finally:
            self._objects -= 1

    @contextlib.contextmanager
    def making(self, where: str) -> Iterator[None]:
        previous, self._made_on = self._made_on, where
        try:
            yield
        finally:
            self._made_on = previous


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _moves_to_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args)


@contextlib.contextmanager
def tracking(recorder: DeviceOpRecorder, *pad_modules: Any) -> Iterator[DeviceOpRecorder]:
    """Activate `recorder`, with `.to(device)`, `.cpu()`, `torch.tensor` and each module's `pad` reporting where
    their results live."""
    original_to, original_cpu, original_tensor = torch.Tensor.to, torch.Tensor.cpu, torch.tensor

    @functools.wraps(original_to)
    def to(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = original_to(self, *args, **kwargs)
        if _moves_to_device(args, kwargs):
            recorder.mark(out, host=False)
        return out

    @functools.wraps(original_cpu)
    def cpu(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with recorder.host_region():
            out = original_cpu(self, *args, **kwargs)
            if out is self:  # on CPU .cpu() returns the tensor itself: the host copy must be a tensor of its own
                out = self.detach().clone()
        recorder.mark(out, host=True)
        return out

    @functools.wraps(original_tensor)
    def tensor(*args, **kwargs):  # type: ignore[no-untyped-def]
        with recorder.making("device" if kwargs.get("device") is not None else "host"):
            return original_tensor(*args, **kwargs)

    pads = [(module, module.pad) for module in pad_modules]
    original_gather_object = torch.distributed.all_gather_object

    @functools.wraps(original_gather_object)
    def all_gather_object(*args, **kwargs):  # type: ignore[no-untyped-def]
        with recorder.object_gather():
            return original_gather_object(*args, **kwargs)

    def host_pad(original):  # type: ignore[no-untyped-def]
        @functools.wraps(original)
        def pad(*args, **kwargs):  # type: ignore[no-untyped-def]
            with recorder.host_region():
                out = original(*args, **kwargs)
            recorder.mark(out, host=True)
            return out

        return pad

    # `torch.device(...)` contexts know their factory functions from a set built once per process
    # (`_device_constructors`, cached): built while `torch.tensor` is the wrapper, it misses the real one, and
    # transformers' test for a meta-device context (`torch.tensor([]).device`) fails. A model built inside `tracking`
    # then skips initializing the weights its checkpoint lacks (a reward model's `score` head stays uninitialized
    # memory, at times NaN or 1e38). So the set is built first, from the real functions.
    _device_constructors()
    torch.Tensor.to, torch.Tensor.cpu, torch.tensor = to, cpu, tensor  # type: ignore[method-assign,assignment]
    torch.distributed.all_gather_object = all_gather_object
    for module, original in pads:
        module.pad = host_pad(original)
    try:
        with outside_data_loading(recorder), recorder:  # type: ignore[arg-type]
            yield recorder
    finally:
        torch.Tensor.to, torch.Tensor.cpu, torch.tensor = original_to, original_cpu, original_tensor  # type: ignore
        torch.distributed.all_gather_object = original_gather_object
        for module, original in pads:
            module.pad = original
