"""How much sooner a real `trl sft` run with torch_compile=True reaches its first steps after `shapeplan warm`.

Side by side in one invocation, on CPU with the bundled tiny model: the same real run (TRL's parser and
`SFTTrainer`, tests/warm/real_sft.py) in a new process, once on an empty Inductor cache (cold) and once on a cache
that `shapeplan warm` filled from the run's plan (warm). Prints the seconds from `train()` to the end of each of
the first steps, the ratio cold/warm, the cache counters of both runs and what the warm-up itself took.

    python benchmarks/warm_speedup.py [--max-length 128] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import CAPYBARA  # noqa: E402  (offline environment, sample data)
from tests.warm.harness import run_argv  # noqa: E402


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(args[:4])} ...\n{proc.stderr[-3000:]}")
    return proc


def real_run(cache: Path, script_lines: list[str], argv: list[str], out: Path, env: dict[str, str]) -> dict:
    spec = {"data": str(CAPYBARA), "argv": argv, "output_dir": str(out), "script_lines": script_lines}
    proc = _run([sys.executable, "-m", "tests.warm.real_sft", json.dumps(spec)],
                {**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    opts = parser.parse_args(argv)
    argv = ["--max_length", str(opts.max_length), "--per_device_train_batch_size", "2", "--max_steps",
            str(opts.steps), "--torch_compile", "true"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    work = Path(tempfile.mkdtemp(prefix="shapeplan-bench-"))
    plan = work / "plan.json"
    _run([sys.executable, "-m", "shapeplan", "analyze", *run_argv(CAPYBARA, argv, work / "out"), "-o", str(plan)],
         env)

    started = time.perf_counter()
    warmed = _run([sys.executable, "-m", "shapeplan", "warm", "--plan", str(plan), "--device", "cpu",
                   "--cache-dir", str(work / "warm-cache"), "--json"], env)
    warm_seconds = time.perf_counter() - started
    report = json.loads(warmed.stdout)
    lines = report["script_lines"]

    cold = real_run(work / "cold-cache", lines, argv, work / "cold", env)
    warm = real_run(work / "warm-cache", lines, argv, work / "warm", env)

    print(f"real trl sft run, torch_compile=True, tiny model on CPU, {len(report['results'])} planned shape(s)")
    print(f"shapeplan warm took {warm_seconds:.1f} s ({', '.join(r['status'] for r in report['results'])})")
    print(f"{'step':>4}  {'cold s':>8}  {'warm s':>8}  {'cold/warm':>9}")
    for i, (c, w) in enumerate(zip(cold["step_ends"], warm["step_ends"], strict=False), start=1):
        print(f"{i:>4}  {c:8.1f}  {w:8.1f}  {c / w:9.1f}x")
    for name, run in (("cold", cold), ("warm", warm)):
        counters = run["counters"]
        print(f"{name} run: " + " ".join(f"{k.split('.')[-1]}={v}" for k, v in sorted(counters.items())
                                         if k.split(".")[-1] in ("fxgraph_cache_miss", "fxgraph_cache_hit",
                                                                 "autograd_cache_miss", "autograd_cache_hit")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
