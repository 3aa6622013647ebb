"""`shapeplan warm` / `verify` refuse bad input with one line naming the problem and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shapeplan.cli import main
from shapeplan.plan.io import write_plan
from tests.conftest import CAPYBARA, TINY_MODEL
from tests.warm.harness import plan_for

ARGV = ["--max_length", "256", "--per_device_train_batch_size", "2", "--max_steps", "2"]


def _error(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_unwritable_cache_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    write_plan(plan_for("sft", CAPYBARA, ARGV, tmp_path / "out"), tmp_path / "plan.json")
    capsys.readouterr()
    assert main(["warm", "--plan", str(tmp_path / "plan.json"), "--device", "cpu", "--cache-dir",
                 str(blocker / "cache")]) == 1
    assert _error(capsys) == [f"Error: cache dir {blocker / 'cache'} is not writable (Not a directory); pass a "
                              "writable folder with --cache-dir"]


def test_plan_for_another_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    write_plan(plan_for("sft", CAPYBARA, ARGV, tmp_path / "out"), plan)
    capsys.readouterr()
    code = main(["warm", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(tmp_path / "c"), str(CAPYBARA),
                 "--model", str(TINY_MODEL), "--bf16", "false", "--max_length", "512",
                 "--per_device_train_batch_size", "2", "--max_steps", "2"])
    assert code == 1
    assert _error(capsys) == ["Error: the plan was made for max_length=256, but this run has 512; re-create the "
                              "plan with `shapeplan analyze ... -o PLAN` for this run"]


def test_options_given_with_a_plan_are_checked_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`warm --plan P --model M` need not repeat the plan's other options: the plan supplies them; a real conflict
    names the field and both values."""
    from shapeplan.services.run import load_run

    plan = tmp_path / "plan.json"
    write_plan(plan_for("sft", CAPYBARA, ARGV, tmp_path / "out"), plan)
    _, warmer = load_run(str(plan), "sft", str(TINY_MODEL), None, None, (), "cpu")
    args = warmer.args
    assert (args.training.max_length, args.training.max_steps, args.model.model_name_or_path) == \
        (256, 2, str(TINY_MODEL))
    _, warmer = load_run(str(plan), "sft", None, None, None, ("--max_steps", "2"), "cpu")
    assert warmer.args.training.max_length == 256
    capsys.readouterr()
    assert main(["warm", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(tmp_path / "c"),
                 "--max_length", "512"]) == 1
    assert _error(capsys) == ["Error: the plan was made for max_length=256, but this run has 512; re-create the "
                              "plan with `shapeplan analyze ... -o PLAN` for this run"]
    assert not (tmp_path / "c").exists()


def test_plan_for_another_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    plan = plan_for("sft", CAPYBARA, ["--model_name_or_path", str(model), *ARGV], tmp_path / "out")
    write_plan(plan, tmp_path / "plan.json")
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    capsys.readouterr()
    assert main(["warm", "--plan", str(tmp_path / "plan.json"), "--device", "cpu", "--cache-dir",
                 str(tmp_path / "c")]) == 1
    assert _error(capsys) == [f"Error: the plan was made with another tokenizer than {model}'s; re-create it with "
                              f"`shapeplan analyze ... --model {model} -o PLAN`"]


def test_warm_plans_first_from_run_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["warm", str(CAPYBARA), "--model", str(TINY_MODEL), "--bf16", "false", *ARGV, "--device", "cpu",
                 "--cache-dir", str(tmp_path / "cache"), "--json"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)
    planned = plan_for("sft", CAPYBARA, ARGV, tmp_path / "out")
    assert [(r["phase"], r["batch"], r["seq"], r["status"]) for r in report["results"]] == [
        (s.phase, s.batch, s.seq, "eager") for s in planned.shapes]
    assert report["device"] == "cpu" and report["script_lines"] == []  # eager: nothing for the script to set
    assert (tmp_path / "cache" / "shapeplan-manifest.json").is_file()


def test_the_trainers_scratch_output_dir_leaves_nothing_behind(tmp_path: Path) -> None:
    """Removed when the warm-up exits; one left by a killed warm-up is removed by the next."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.plan.test_plan_core import dead_pid

    stale = tmp_path / f"shapeplan-warm-{dead_pid()}-abc123"
    stale.mkdir()
    (stale / "trainer_state.json").write_text("{}")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", "from shapeplan.warm.trainer_setup import _scratch_output_dir as s; "
                           "import os; print(os.path.isdir(s()))"], env=env, capture_output=True, text=True,
                          check=True, timeout=300)
    assert done.stdout.strip() == "True"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("shapeplan-warm-")] == []


def test_an_eager_warm_up_is_not_a_complete_cache_and_its_log_rows_count_and_time(tmp_path: Path) -> None:
    """Through the console script, stderr a pipe (a log): each finished shape's row carries k/N, its seconds, the
    time so far and the estimated total. An eager cpu warm-up caches nothing, so `warm --status` counts its shapes
    as eager, not done, and exits 1 with a line saying how to warm a cache (a bake gate on it fails). `-q` leaves
    warm's and verify's stderr to errors and warnings."""
    import re

    from tests import console

    plan = tmp_path / "plan.json"
    write_plan(plan_for("sft", CAPYBARA, [*ARGV, "--max_length", "384", "--max_steps", "4"], tmp_path / "out"), plan)
    total = len(json.loads(plan.read_text())["shapes"])
    assert total >= 2
    cache = ["--device", "cpu", "--cache-dir", str(tmp_path / "cache")]
    warmed = console.run(["warm", "--plan", plan, *cache])
    assert warmed.returncode == 0, warmed.stderr
    rows = [line for line in warmed.stderr.splitlines() if line.startswith("[")]
    assert [line.split(",")[0] for line in rows] == [f"[{k}/{total}" for k in range(1, total + 1)], warmed.stderr
    for line in rows:
        assert re.fullmatch(r"\[\d+/\d+, \d+s elapsed, ~\d+s total\] eager +train \(2, \d+\) +\d+\.\ds +", line), line
    status = console.run(["warm", "--plan", plan, "--status", *cache])
    assert status.returncode == 1
    assert f"0/{total} shape(s) done, incomplete: 0 compiled, 0 cached, {total} eager  (cache: " in status.stdout
    (line,) = status.stderr.splitlines()
    assert line.startswith(f"warning: {total} shape(s) only ran eager") and "--torch_compile true" in line \
        and "--device neuron" in line, line
    counts = json.loads(console.run(["warm", "--plan", plan, "--status", *cache, "--json"]).stdout)
    assert counts["counts"] == {"compiled": 0, "cached": 0, "eager": total, "missing": 0} and not counts["complete"]
    quiet = ["--device", "cpu", "--cache-dir", str(tmp_path / "quiet")]
    silent = console.run(["warm", "-q", "--plan", plan, *quiet, "--env-file", tmp_path / "env"])
    assert (silent.returncode, silent.stderr) == (0, "") and f"{total} eager" in silent.stdout
    checked = console.run(["verify", "--quiet", "--plan", plan, *quiet])
    assert (checked.returncode, checked.stderr) == (0, "") and "verify: nothing to compile" in checked.stdout


def test_a_torch_compile_warm_up_on_cpu_says_first_that_each_shape_costs_minutes(tmp_path: Path) -> None:
    """One line before the first shape compiles (the process is stopped there: the compile itself takes minutes)."""
    import os
    import signal
    import subprocess

    from tests import console
    from tests.conftest import ROOT

    plan = tmp_path / "plan.json"
    write_plan(plan_for("sft", CAPYBARA, [*ARGV, "--torch_compile", "true"], tmp_path / "out"), plan)
    process = subprocess.Popen([console.SHAPEPLAN, "warm", "--plan", str(plan), "--device", "cpu", "--cache-dir",
                                str(tmp_path / "cache")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert process.stderr is not None
    try:
        lines = []
        for line in process.stderr:
            lines.append(line)
            if line.startswith("note: ") or line.startswith("["):  # the note, or (too late) a shape's row
                break
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    notes = [line for line in lines if line.startswith("note: ")]
    assert len(notes) == 1 and "torch_compile on CPU" in notes[0] and "a minute or more a shape" in notes[0], lines
