"""Errors shapeplan raises on purpose. The CLI maps each to an exit code and prints its message as one line.

    ShapeplanError            anything shapeplan reports instead of a traceback (exit 1)
    ├── UsageError            the command line or config is wrong (exit 2)
    ├── DatasetError          the dataset is missing, unreadable, empty or unusable (exit 1)
    ├── ModelError            the model or tokenizer cannot be loaded or used (exit 1)
    ├── PlanFileError         a plan file is missing, malformed or does not match (exit 1)
    ├── CacheError            a compile cache dir cannot be used (exit 1)
    │   └── CacheMismatchError    a cache archive was compiled for another environment (exit 3)
    └── UnplannedShapeError   a guarded run (`on_unplanned="error"`) met a shape its plan lacks (exit 4)

Every message names the problem and the fix in one line.
"""

from __future__ import annotations


class ShapeplanError(Exception):
    """Base class; `str(error)` is the one line the CLI prints."""

    exit_code = 1


class UsageError(ShapeplanError):
    exit_code = 2


class DatasetError(ShapeplanError):
    pass


class ModelError(ShapeplanError):
    pass


class PlanFileError(ShapeplanError):
    pass


class CacheError(ShapeplanError):
    pass


class CacheMismatchError(CacheError):
    """Its own exit code, so that an image pipeline can fall back to warming instead of failing."""

    exit_code = 3


class UnplannedShapeError(ShapeplanError):
    """Raised before the forward of a shape the plan lacks, so no compile minutes are spent on it. Its own exit code,
    so that a pipeline can tell a stale plan from a failed run."""

    exit_code = 4
