"""What `shapeplan cache import` accepts (its own module so that the CLI reads the defaults without importing the
archive code)."""

from __future__ import annotations

from dataclasses import dataclass

_GIB = 1 << 30
_MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Limits:
    """What an import accepts, checked before writing: generous for a Neuron cache of thousands of NEFFs."""

    max_bytes: int = 256 * _GIB  # the files' expanded total
    max_files: int = 1_000_000
    max_metadata: int = 256 * _MIB  # the size of shapeplan-archive.json


DEFAULT_LIMITS = Limits()
