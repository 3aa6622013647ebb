"""torch.compile: after `shapeplan warm` into a fresh cache dir, the real run in a new process compiles nothing
(zero FX-graph and AOTAutograd cache misses); a second warm and `shapeplan verify` compile nothing either."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CAPYBARA, ROOT
from tests.warm.harness import run_argv

pytestmark = pytest.mark.slow

# One shape, (2, 128): every row is cut or padded to 128.
ARGV = ["--max_length", "128", "--per_device_train_batch_size", "2", "--max_steps", "2", "--torch_compile", "true"]


def shapeplan(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shapeplan", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)


def real_run_in_new_process(cache: Path, script_lines: list[str], out: Path, env: dict[str, str]) -> dict:
    spec = {"data": str(CAPYBARA), "argv": ARGV, "output_dir": str(out), "script_lines": script_lines}
    proc = subprocess.run([sys.executable, "-m", "tests.warm.real_sft", json.dumps(spec)], cwd=ROOT,
                          env={**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)}, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_warm_then_real_run_has_no_cache_miss(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plan, cache = tmp_path / "plan.json", tmp_path / "cache"
    analyzed = shapeplan("analyze", *run_argv(CAPYBARA, ARGV, tmp_path / "out"), "-o", str(plan), env=env)
    assert analyzed.returncode == 0, analyzed.stderr

    warmed = shapeplan("warm", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache), "--json", env=env)
    assert warmed.returncode == 0, warmed.stderr[-3000:]
    report = json.loads(warmed.stdout)
    assert [(r["phase"], r["batch"], r["seq"], r["status"]) for r in report["results"]] == [
        ("train", 2, 128, "compiled")]
    assert report["results"][0]["counters"]["fxgraph_cache_miss"] > 0

    run = real_run_in_new_process(cache, report["script_lines"], tmp_path / "run", env)
    counters = run["counters"]
    assert counters.get("inductor.fxgraph_cache_miss", 0) == 0, counters
    assert counters.get("aot_autograd.autograd_cache_miss", 0) == 0, counters
    # ... and the warm-up compiled nothing the run does not use: the run hits every graph the warm-up compiled.
    warmed = report["results"][0]["counters"]
    assert counters.get("inductor.fxgraph_cache_hit") == warmed["fxgraph_cache_miss"], (counters, warmed)
    assert counters.get("aot_autograd.autograd_cache_hit") == warmed["autograd_cache_miss"], (counters, warmed)

    again = shapeplan("warm", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache), "--json", env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["status"] for r in json.loads(again.stdout)["results"]] == ["skipped"]

    verified = shapeplan("verify", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache), "--json",
                         env=env)
    assert verified.returncode == 0, verified.stderr[-3000:]
    results = json.loads(verified.stdout)["results"]
    assert [r["status"] for r in results] == ["cached"]
    assert results[0]["counters"].get("fxgraph_cache_miss", 0) == 0
