"""Calls into the user's own Python objects: the modules `--tools`, `--environment_factory` and `--rollout_func` name
(importing one runs it), an environment factory, an environment's `reset`, a rollout function.

Such code can raise anything, `SystemExit` included: a `sys.exit(0)` in a tools module would end shapeplan with exit
0 and no plan, a `sys.exit(3)` with a code that means something else here (README's table). `user_code` turns
whatever it raises, but `KeyboardInterrupt`, into one `UsageError` (exit 2) naming the object, what it did and the
fix. What the code prints goes to stderr: stdout carries only shapeplan's own output (`analyze --json`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from ..errors import ShapeplanError, UsageError, first_line


def name_of(thing: Any) -> str:
    """`module:qualname` of a user's object, as `--tools` and the other options name one."""
    return f"{getattr(thing, '__module__', '?')}:{getattr(thing, '__qualname__', repr(thing))}"


def problem(exc: BaseException) -> str:
    """What the user's code did, as the clause after its name: `called sys.exit(3)`, `raised ValueError: ...`."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({'' if exc.code is None else repr(exc.code)[:80]})"
    return f"raised {first_line(exc, named=True)}"


@contextlib.contextmanager
def user_code(subject: str, fix: str) -> Iterator[None]:
    """Run the block, a call into the user's code, as `subject` (the object, named as the user knows it): anything
    it raises or exits with becomes `UsageError("<subject> <problem>; <fix>")`, and its prints go to stderr. A
    `ShapeplanError` passes unchanged (shapeplan's own refusal, from a callback the code was handed), as does
    `KeyboardInterrupt` (the user stopping shapeplan)."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except (KeyboardInterrupt, ShapeplanError):
        raise
    except BaseException as exc:  # SystemExit and GeneratorExit too: the user's code does not decide the exit
        raise UsageError(f"{subject} {problem(exc)}; {fix}") from exc
