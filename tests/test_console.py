"""tests/console.py's forked console calls are the fresh console script's: the same exit code, stdout, stderr and
written files, for a refusal made before TRL is imported, one made by TRL's parser, and a plan written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests import console
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL


@pytest.mark.skipif(os.environ.get("SHAPEPLAN_TESTS_FRESH") == "1", reason="every console call is fresh already")
def test_a_forked_call_is_the_fresh_console_script(tmp_path: Path) -> None:
    calls = {
        "refused before TRL": ["analyze", "missing.jsonl", "--model", str(TINY_MODEL)],
        "refused by TRL's parser": ["analyze", str(CAPYBARA), "--model", str(TINY_MODEL), "--max_lenght", "5"],
        "a plan written": ["analyze", str(CAPYBARA), "--model", str(TINY_MODEL), "--max_length", "256", "--no-cache",
                           "--json", "-o", "plan.json"],
    }
    codes = set()
    for name, args in calls.items():
        runs = []
        for way, cwd in (("forked", tmp_path / "forked"), ("fresh", tmp_path / "fresh")):
            cwd.mkdir(exist_ok=True)
            done = (console.run(args, cwd=cwd) if way == "forked"
                    else console.fresh(args, cwd, {**os.environ, "PYTHONPATH": str(ROOT)}, 600))
            written = {p.name: p.read_bytes() for p in cwd.iterdir()}
            runs.append((done.returncode, done.stdout, done.stderr, written))
        assert runs[0] == runs[1], name
        codes.add(runs[0][0])
    assert codes == {0, 1, 2}
    assert console._servers and not next(iter(console._servers.values())).unfit  # the calls above were forked


def test_a_call_past_its_timeout_is_killed_and_the_server_serves_on(tmp_path: Path) -> None:
    warm = ["warm", str(CAPYBARA), "--model", str(TINY_MODEL), "--max_length", "128", "--per_device_train_batch_size",
            "2", "--max_steps", "1", "--device", "cpu", "--cache-dir", "cache"]  # loads a model, runs a trainer step
    with pytest.raises(subprocess.TimeoutExpired):
        console.run(warm, cwd=tmp_path, timeout=0.5)
    assert console.run(["analyze", "missing.jsonl", "--model", str(TINY_MODEL)], cwd=tmp_path).returncode == 1


PROBE = """import json, os, sys, time
print(json.dumps({"argv": sys.argv, "path": sys.path[0], "name": __name__, "cwd": os.getcwd(),
                  "rank": os.environ.get("RANK"), "pid": os.getpid()}), flush=True)
if sys.argv[-1] == "wait":
    time.sleep(60)
sys.exit(3)
"""


@pytest.mark.skipif(os.environ.get("SHAPEPLAN_TESTS_FRESH") == "1", reason="every process is fresh already")
def test_forked_python_runs_a_script_or_module_as_python_does(tmp_path: Path) -> None:
    """tests/forked_python.py standing for `python` (the ranks of a launch): the same argv, sys.path[0], __name__,
    working directory, environment, output and exit code as `python` itself; a client killed takes its child
    along."""
    import json
    import signal
    import sys
    import time

    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "RANK": "1"}
    python, forked_env = console.forked_python(env)
    assert python[1:], "the worker's server is fit"
    for args in (["probe.py", "a"], ["-m", "probe", "a"]):
        done = [subprocess.run([*command, *args], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=60)
                for command, e in ((python, forked_env), ([sys.executable], env))]
        seen = [json.loads(d.stdout) for d in done]
        assert [d.returncode for d in done] == [3, 3] and seen[0]["pid"] != seen[1]["pid"]
        assert [{**s, "pid": 0} for s in seen] == [{**seen[1], "pid": 0}] * 2, args
    waiting = subprocess.Popen([*python, "probe.py", "wait"], cwd=tmp_path, env=forked_env, stdout=subprocess.PIPE,
                               text=True)
    assert waiting.stdout is not None
    child = json.loads(waiting.stdout.readline())["pid"]
    waiting.send_signal(signal.SIGKILL)
    waiting.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}")
