"""Padding rules, each defined once."""

from __future__ import annotations


def round_up(length: int, multiple: int | None) -> int:
    """The padded length TRL's `pad` gives a batch whose longest row is `length` (it never truncates)."""
    if multiple is None or length % multiple == 0:
        return length
    return (length // multiple + 1) * multiple
