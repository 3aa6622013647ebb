"""kill -9 in the middle of `shapeplan warm` leaves a valid manifest of completed shapes; the next run skips
exactly those and warms the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shapeplan.warm.manifest import MANIFEST
from tests.conftest import CAPYBARA, ROOT
from tests.warm.harness import run_argv

pytestmark = pytest.mark.slow

ARGV = ["--max_length", "512", "--per_device_train_batch_size", "2", "--max_steps", "8"]


def _shapes(manifest: Path) -> dict[str, str]:
    data = json.loads(manifest.read_text())
    (section,) = data["environments"].values()
    return {key: entry["status"] for key, entry in section["shapes"].items()}


def test_kill_9_then_resume(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plan, cache = tmp_path / "plan.json", tmp_path / "cache"
    analyzed = subprocess.run([sys.executable, "-m", "shapeplan", "analyze", *run_argv(CAPYBARA, ARGV, tmp_path),
                               "--json", "-o", str(plan)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert analyzed.returncode == 0, analyzed.stderr
    planned = [f"train {s['batch']}x{s['seq']}" for s in json.loads(analyzed.stdout)["shapes"]]
    assert len(planned) >= 3

    command = [sys.executable, "-m", "shapeplan", "warm", "--plan", str(plan), "--device", "cpu", "--cache-dir",
               str(cache), "--json"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    manifest = cache / MANIFEST
    deadline = time.monotonic() + 600
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "warm finished before it could be killed"

    done = _shapes(manifest)  # valid JSON: written atomically
    assert 1 <= len(done) < len(planned)
    assert set(done) <= set(planned) and set(done.values()) == {"eager"}  # eager CPU compiles nothing

    resumed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    statuses = {r["key"]: r["status"] for r in json.loads(resumed.stdout)["results"]}
    assert statuses == {key: "skipped" if key in done else "eager" for key in planned}
    assert _shapes(manifest) == {key: "eager" for key in planned}
