"""Errors shapeplan raises on purpose. The CLI maps each to an exit code and prints its message as one line.

    ShapeplanError            anything shapeplan reports instead of a traceback (exit 1)
    ├── UsageError            the command line or config is wrong (exit 2)
    ├── DatasetError          the dataset is missing, unreadable, empty or unusable (exit 1)
    ├── ModelError            the model or tokenizer cannot be loaded or used (exit 1)
    ├── PlanFileError         a plan file is missing, malformed or does not match (exit 1)
    ├── ScriptError           a training script failed or ended before building its trainer (exit 1)
    ├── CacheError            a compile cache dir cannot be used (exit 1)
    │   └── CacheMismatchError    a cache archive was compiled for another environment (exit 3)
    └── UnplannedShapeError   a guarded run (`on_unplanned="error"`) met a shape its plan lacks (exit 4)

Every message names the problem and the fix in one line. The edges turn what the outside world raises into these:

    plan file       OSError, UnicodeDecodeError, JSON errors, wrong types/ranges  -> PlanFileError
    manifest        OSError, UnicodeDecodeError, JSON errors, wrong structure     -> CacheError
    cache archive   OSError, EOFError, gzip/tar errors, bad metadata, limits      -> CacheError
                    another environment                                           -> CacheMismatchError
    output paths    OSError on -o, --cache-dir or an import target                -> PlanFileError / CacheError
    options         out-of-range sizes, counts and epochs                         -> UsageError

Each error's exit code is in one table, `EXIT_CODES` (below the classes); a new subclass must be added to it
(`tests/test_errors.py` fails on one that is not). `SHAPEPLAN_DEBUG=1` makes the CLI print the traceback behind the
one line.

An error may carry the values it is about as keyword attributes (`PlanFileError(msg, field="seq", value=0)`
has `.field` and `.value`), for callers that handle it programmatically.
"""

from __future__ import annotations

from typing import Any


class ShapeplanError(Exception):
    """Base class; `str(error)` is the one line the CLI prints, `exit_code` the code it exits with."""

    def __init__(self, message: str, **values: Any) -> None:
        super().__init__(message)
        self.values = values
        for name, value in values.items():
            setattr(self, name, value)

    @property
    def exit_code(self) -> int:
        """The code of the nearest class in `EXIT_CODES` (a listed class's own, since the test lists them all)."""
        return next(EXIT_CODES[cls] for cls in type(self).__mro__ if cls in EXIT_CODES)


class UsageError(ShapeplanError):
    pass


class DatasetError(ShapeplanError):
    pass


class ModelError(ShapeplanError):
    pass


class PlanFileError(ShapeplanError):
    pass


class ScriptError(ShapeplanError):
    """A user's training script (script mode: `analyze -- python train.py`) raised, exited or finished before it
    built the trainer shapeplan plans."""


class CacheError(ShapeplanError):
    pass


class CacheMismatchError(CacheError):
    """Its own exit code, so that an image pipeline can fall back to warming instead of failing."""


class UnplannedShapeError(ShapeplanError):
    """Raised before the forward of a shape the plan lacks, so no compile minutes are spent on it. Its own exit code,
    so that a pipeline can tell a stale plan from a failed run."""


# The exit code of every error class: the README's exit-code table is made of these.
EXIT_CODES: dict[type[ShapeplanError], int] = {
    ShapeplanError: 1,
    UsageError: 2,
    DatasetError: 1,
    ModelError: 1,
    PlanFileError: 1,
    ScriptError: 1,
    CacheError: 1,
    CacheMismatchError: 3,
    UnplannedShapeError: 4,
}


def first_line(exc: BaseException, *, named: bool = False) -> str:
    """The first line of `exc`'s message, for a one-line error or a failed shape's row; `named` puts the exception's
    type in front (`ValueError: ...`). A message-less exception is its type's name."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if named:
        return f"{type(exc).__name__}: {line}".rstrip(": ")
    return line or type(exc).__name__
