"""stdout carries results (the table, or JSON under --json); everything else goes to stderr."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import click

from ..plan.cost import GENERATE_SHAPE_MINUTES
from ..plan.io import dumps
from ..plan.model import Plan
from ..plan.targets import write_plan_output
from ..services.report import render_plan, render_warm, result_row
from ..warm.model import WarmReport, WarmResult

if TYPE_CHECKING:
    from ..services.trl_command import TrlCommand


_QUIET = "shapeplan.quiet"  # the key of ctx.meta (shared by every nested context) that -q/--quiet sets


def remember_quiet(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """-q/--quiet's callback: the command's stderr carries only errors and warnings."""
    if value:
        ctx.meta[_QUIET] = True


def quiet() -> bool:
    """Whether the command runs under -q/--quiet (or is a `warm --workers` worker of one: SHAPEPLAN_QUIET=1)."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get(_QUIET)) or os.environ.get("SHAPEPLAN_QUIET") == "1"


def note(text: str) -> None:
    """A line for people on stderr (what was written where, what to run next), left out under -q/--quiet; errors
    and warnings are never left out."""
    if not quiet():
        click.echo(text, err=True)


def emit_plan(plan: Plan, *, as_json: bool, output: str | None,
              generate_minutes: float = GENERATE_SHAPE_MINUTES, inputs: Sequence[str] = ()) -> None:
    if output is not None:
        write_plan_output(plan, output, inputs)
    if as_json:
        click.echo(dumps(plan), nl=False)
    else:
        click.echo(render_plan(plan, generate_minutes=generate_minutes))
        if output is not None:
            note(f"plan written to {output}")
    script = plan.config.get("command")
    if output is not None and isinstance(script, list):  # a script's run: the next two steps, one command line each
        quoted = shlex.quote(output)
        note(f"next: shapeplan warm --plan {quoted}, then train with `shapeplan guard --plan {quoted} -- "
             f"{shlex.join(script)}`")


def emit_caveats(plan: Plan, *, with_plan_warnings: bool) -> None:
    """The run's known breakages (`plan.caveats`) on stderr, after the plan's own warnings (`with_plan_warnings`:
    where no plan report has shown them, as before a warm-up)."""
    from ..plan.caveats import caveats

    for warning in [*(plan.warnings if with_plan_warnings else ()), *caveats(plan, os.environ)]:
        click.echo(f"warning: {warning}", err=True)


class ProgressBar:
    """A warm-up's progress on stderr (a `warm.tracker.Progress`): a row per finished shape, and below them a tqdm
    bar when stderr is a terminal (in a log, a bar's redraws would run into the rows, so there each row carries the
    count, the time so far and the estimated total instead). While it runs, log records are written above the bar
    as the rows are, never into it; Python warnings (transformers' FutureWarnings, met again with every shape's
    trainer) are kept out of the rows and shown once each when it closes. `quiet` (-q): no rows and no bar, the
    warnings still."""

    def __init__(self, what: str = "warming", *, quiet: bool = False) -> None:
        self.what = what
        self.quiet = quiet
        self._bar: Any = None
        self._redirect: contextlib.ExitStack | None = None
        self._caught: list[Any] = []  # the Python warnings met while it runs, shown once each after the rows
        self._log = False  # stderr is no terminal: each row carries its own progress
        self._total = 0
        self._started = 0.0
        self._seconds = 0.0  # the finished shapes' own seconds, for the estimate
        self._done = 0
        self.rows = 0  # rows written to stderr

    def begin(self, total: int) -> None:
        import logging
        import time

        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._log = not sys.stderr.isatty()
        self._total = total
        self._started = time.monotonic()
        self._bar = tqdm(total=total, desc=self.what, unit="shape", file=sys.stderr, dynamic_ncols=True,
                         disable=self.quiet or self._log)
        self._redirect = contextlib.ExitStack()
        library = logging.getLogger("transformers")  # its own handler, not propagated, once transformers set it up
        loggers = [logging.root, *([library] if not library.propagate else [])]
        self._redirect.enter_context(logging_redirect_tqdm(loggers))
        # libraries' warnings (transformers' FutureWarnings, once per shape's trainer) would land between the rows
        self._caught = self._redirect.enter_context(warnings.catch_warnings(record=True))

    def done(self, result: WarmResult) -> None:
        import time

        self._seconds += result.seconds
        self._done += 1
        done = self._done
        self._bar.update(1)
        if self.quiet:
            return
        row = result_row(result)
        if self._log:
            elapsed = time.monotonic() - self._started
            total = elapsed + self._seconds / done * (self._total - done)  # the shapes left at this pace
            row = f"[{done}/{self._total}, {duration(elapsed)} elapsed, ~{duration(total)} total] {row}"
        self._bar.write(row, file=sys.stderr)
        self.rows += 1

    def close(self) -> None:
        if self._redirect is not None:
            self._redirect.close()
        self._bar.close()
        shown: set[tuple[str, str]] = set()
        for caught in self._caught:
            text = (caught.category.__name__, " ".join(str(caught.message).split()))
            if text not in shown:
                shown.add(text)
                click.echo(f"warning: {text[0]}: {text[1]}", err=True)
        self._caught = []


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`: a warm-up's time, as a log line shows it."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def same_destination() -> bool:
    """Whether stdout and stderr go to the same place (a terminal, or `> log 2>&1`): what one shows, the other
    need not repeat."""
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # no real file behind them (a test's capture)
        return False
    return (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino)


def emit_warm(report: WarmReport, *, as_json: bool, verify: bool, command: TrlCommand | None = None,
              env_file: str | None = None, rows_shown: bool = False) -> None:
    """The warm (or verify) report on stdout, with the training `command` to run next; exit code 1 if a shape
    failed, or under `verify` compiled. `rows_shown`: the per-shape rows went to stderr as the shapes finished, so
    where stderr is also stdout they are not printed again."""
    if as_json:
        out = report.to_dict()
        if command is not None:
            out["command"] = list(command.words)
        click.echo(json.dumps(out, indent=2))
    else:
        rows = not (rows_shown and same_destination())
        click.echo(render_warm(report, verify=verify, command=command, env_file=env_file, rows=rows))
    if report.failed or (verify and report.compiled):
        raise click.exceptions.Exit(1)


def quiet_libraries() -> None:
    """stderr carries the per-shape rows: keep the libraries' own progress bars and notices off it."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
