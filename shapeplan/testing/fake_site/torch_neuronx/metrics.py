"""torch_neuronx.metrics of the fake (see __init__): counter values, None for a counter never bumped."""

from __future__ import annotations

from . import MODES, counters

if "no_metrics" in MODES or "xla" in MODES:
    raise ModuleNotFoundError("No module named 'torch_neuronx.metrics'", name="torch_neuronx.metrics")


def get_counter_value(name: str) -> int | None:
    return counters.get(name)
