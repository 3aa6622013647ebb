"""The warm-up's progress on stderr: rows and Python warnings (transformers' FutureWarnings) are written above the
bar on a terminal, never into it, the warnings once each after the rows; in a log (no terminal) there is no bar to
run into, and each row carries the count and the times instead; rows shown on stderr are not repeated on stdout
where both go to one place."""

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


def test_a_warning_met_with_every_shape_is_shown_once_after_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        bar = ProgressBar()
        bar.begin(2)
        for seq in (128, 256):  # each shape's trainer warns again
            warnings.warn("`gradient_checkpointing` is deprecated", FutureWarning, stacklevel=1)
            bar.done(WarmResult(task=WarmTask(phase="train", batch=4, seq=seq), status="eager", seconds=1.0))
        bar.close()
    lines = sys.stderr.getvalue().splitlines()
    (warning,) = [i for i, line in enumerate(lines) if "gradient_checkpointing" in line]
    assert lines[warning] == "warning: FutureWarning: `gradient_checkpointing` is deprecated"
    assert warning > max(i for i, line in enumerate(lines) if "eager     train" in line) and bar.rows == 2


def test_rows_shown_on_stderr_are_not_repeated_where_stdout_is_the_same_place(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from shapeplan.cli.output import same_destination
    from shapeplan.services.report import render_warm
    from shapeplan.warm.model import WarmReport

    report = WarmReport(results=(WarmResult(task=WarmTask(phase="train", batch=4, seq=256), status="eager",
                                            seconds=1.0),), cache_dir="/c", device="cpu", environment={})
    assert "train (4, 256)" in render_warm(report, verify=False)
    assert "train (4, 256)" not in render_warm(report, verify=False, rows=False)
    with open(tmp_path / "log", "w") as log, open(tmp_path / "log", "a") as same, open(tmp_path / "o", "w") as other:
        monkeypatch.setattr(sys, "stdout", log)
        monkeypatch.setattr(sys, "stderr", same)  # `> log 2>&1`
        assert same_destination()
        monkeypatch.setattr(sys, "stderr", other)
        assert not same_destination()


def test_in_a_log_each_row_carries_its_count_the_time_so_far_and_the_estimated_total(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate: the time so far plus the shapes left at the finished shapes' average. On a terminal the rows
    stay as they were (the bar below them counts); under -q (`quiet`) there are no rows, the warnings still."""
    import time

    ticks = [100.0, 112.0, 135.0]  # begin, then each shape's end
    monkeypatch.setattr(time, "monotonic", lambda: ticks.pop(0) if ticks else 0.0)

    def rows(stderr: io.StringIO, *, quiet: bool = False) -> list[str]:
        monkeypatch.setattr(sys, "stderr", stderr)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            bar = ProgressBar(quiet=quiet)
            bar.begin(3)
            warnings.warn("`gradient_checkpointing` is deprecated", FutureWarning, stacklevel=1)
            for seq, seconds in ((128, 10.0), (256, 20.0)):
                bar.done(WarmResult(task=WarmTask(phase="train", batch=4, seq=seq), status="cached", seconds=seconds))
            bar.close()
        return [s for s in re.split(r"[\r\n]", stderr.getvalue()) if s.strip()]

    assert rows(io.StringIO())[:2] == [
        "[1/3, 12s elapsed, ~32s total] cached    train (4, 128)             10.0s  ",
        "[2/3, 35s elapsed, ~50s total] cached    train (4, 256)             20.0s  "]
    on_terminal = rows(Terminal())
    assert "cached    train (4, 128)             10.0s  " in on_terminal
    assert not any("elapsed" in s for s in on_terminal)
    assert rows(io.StringIO(), quiet=True) == ["warning: FutureWarning: `gradient_checkpointing` is deprecated"]


def test_durations_read_as_a_log_reads_them() -> None:
    from shapeplan.cli.output import duration

    assert [duration(s) for s in (0.4, 42, 185, 3725)] == ["0s", "42s", "3m05s", "1h02m"]
