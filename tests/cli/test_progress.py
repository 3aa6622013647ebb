"""The warm-up's progress on stderr: rows and Python warnings (transformers' FutureWarnings) are written above the
bar on a terminal, never into it; in a log (no terminal) there is no bar to run into."""

from __future__ import annotations

import io
import re
import sys
import warnings

import pytest

from shapeplan.cli.output import ProgressBar
from shapeplan.warm.model import WarmResult, WarmTask


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stderr: io.StringIO, monkeypatch: pytest.MonkeyPatch, what: str = "warming") -> str:
    monkeypatch.setattr(sys, "stderr", stderr)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        bar = ProgressBar(what)
        bar.begin(2)
        warnings.warn("`gradient_checkpointing` is deprecated", FutureWarning, stacklevel=1)
        bar.done(WarmResult(task=WarmTask(phase="train", batch=4, seq=256), status="eager", seconds=1.0))
        bar.close()
    return stderr.getvalue()


def test_rows_and_warnings_are_written_above_the_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _run(Terminal(), monkeypatch)
    segments = [s.strip() for s in re.split(r"[\r\n]", text) if s.strip()]
    assert any(s.startswith("warming:") for s in segments)  # the bar is drawn
    for needle in ("eager     train (4, 256)", "FutureWarning: `gradient_checkpointing`"):
        (found,) = [s for s in segments if needle in s]
        assert "warming" not in found and "%|" not in found  # a line of its own, not in the bar's


def test_no_bar_in_a_log_and_verify_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _run(io.StringIO(), monkeypatch, "verifying")
    assert "\r" not in text and "warming" not in text and "%|" not in text
    assert "eager     train (4, 256)" in text and "FutureWarning" in text
    assert "verifying:" in _run(Terminal(), monkeypatch, "verifying")
