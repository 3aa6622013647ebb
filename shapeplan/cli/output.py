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


def emit_plan(plan: Plan, *, as_json: bool, output: str | None,
              generate_minutes: float = GENERATE_SHAPE_MINUTES, inputs: Sequence[str] = ()) -> None:
    if output is not None:
        write_plan_output(plan, output, inputs)
    if as_json:
        click.echo(dumps(plan), nl=False)
    else:
        click.echo(render_plan(plan, generate_minutes=generate_minutes))
        if output is not None:
            click.echo(f"plan written to {output}", err=True)
    script = plan.config.get("command")
    if output is not None and isinstance(script, list):  # a script's run: the next two steps, one command line each
        quoted = shlex.quote(output)
        click.echo(f"next: shapeplan warm --plan {quoted}, then train with `shapeplan guard --plan {quoted} -- "
                   f"{shlex.join(script)}`", err=True)


def emit_caveats(plan: Plan, *, with_plan_warnings: bool) -> None:
    """The run's known breakages (`plan.caveats`) on stderr, after the plan's own warnings (`with_plan_warnings`:
    where no plan report has shown them, as before a warm-up)."""
    import os

    from ..plan.caveats import caveats

    for warning in [*(plan.warnings if with_plan_warnings else ()), *caveats(plan, os.environ)]:
        click.echo(f"warning: {warning}", err=True)


class ProgressBar:
    """A warm-up's progress on stderr (a `warm.tracker.Progress`): a row per finished shape, and below them a tqdm
    bar when stderr is a terminal (in a log, a bar's redraws would run into the rows). While it runs, log records
    are written above the bar as the rows are, never into it; Python warnings (transformers' FutureWarnings, met
    again with every shape's trainer) are kept out of the rows and shown once each when it closes."""

    def __init__(self, what: str = "warming") -> None:
        self.what = what
        self._bar: Any = None
        self._redirect: contextlib.ExitStack | None = None
        self._caught: list[Any] = []  # the Python warnings met while it runs, shown once each after the rows
        self.rows = 0  # rows written to stderr

    def begin(self, total: int) -> None:
        import logging

        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar = tqdm(total=total, desc=self.what, unit="shape", file=sys.stderr, dynamic_ncols=True,
                         disable=not sys.stderr.isatty())
        self._redirect = contextlib.ExitStack()
        library = logging.getLogger("transformers")  # its own handler, not propagated, once transformers set it up
        loggers = [logging.root, *([library] if not library.propagate else [])]
        self._redirect.enter_context(logging_redirect_tqdm(loggers))
        # libraries' warnings (transformers' FutureWarnings, once per shape's trainer) would land between the rows
        self._caught = self._redirect.enter_context(warnings.catch_warnings(record=True))

    def done(self, result: WarmResult) -> None:
        self._bar.write(result_row(result), file=sys.stderr)
        self._bar.update(1)
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
