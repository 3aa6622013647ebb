"""torch_neuronx.metrics of the fake (see __init__): the metrics arena's counters (None for a counter never bumped)
and the runtime switch, as upstream's metrics.py wraps `_C`."""

from __future__ import annotations

from . import MODES, counters, metrics_enabled, set_metrics_enabled

if "no_metrics" in MODES or "xla" in MODES:
    raise ModuleNotFoundError("No module named 'torch_neuronx.metrics'", name="torch_neuronx.metrics")


def is_enabled() -> bool:
    return metrics_enabled()


def set_enabled(enabled: bool) -> None:
    set_metrics_enabled(enabled)


def get_counter_names() -> list[str]:
    return sorted(counters)


def get_counter_value(name: str) -> int | None:
    return counters.get(name)
