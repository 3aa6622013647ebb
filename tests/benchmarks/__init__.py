"""The benchmarks in benchmarks/, run small (their scripts import as modules from that folder)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from tests.conftest import ROOT


def benchmark(name: str) -> ModuleType:
    """benchmarks/`name`.py as a module."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
