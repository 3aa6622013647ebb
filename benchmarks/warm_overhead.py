"""The warm-up's own overhead: `shapeplan warm`'s wall time against the compile time it buys.

Side by side in one invocation, on CPU with the bundled tiny model, a run of one planned shape (two rows of
--max-length tokens a step, one step, torch_compile=True), each part a new process on an empty Inductor cache:

  warm   `shapeplan warm --plan PLAN --device cpu`: wall clock from the process's start to its exit
  cold   the real run (TRL's parser and `SFTTrainer`, as tests/warm/real_sft.py runs it):
         wall clock from the process's start to the end of its first step: the compile time the warm-up buys,
         in the same kind of process (interpreter, imports, model, data and compile included)

and, beside, the real run once more on the cache the warm-up filled (what the run is left to wait for). Prints the
seconds, warm/cold (the overhead: target <= 1.1) and where the warm-up's time went (its phases, from the report).
The parts run in turn, `--repeat` times; the fastest of each is kept.

    python benchmarks/warm_overhead.py [--max-length 128] [--repeat 1] [--json out.json]
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import CAPYBARA  # noqa: E402  (offline environment, sample data)
from tests.warm.harness import run_argv  # noqa: E402


def _run(args: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """The finished process, the wall clock (time.time) at its start and its wall seconds."""
    started, clock = time.time(), time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - clock
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(args[:5])} ...\n{proc.stderr[-3000:]}")
    return proc, started, seconds


def real_run(cache: Path, script_lines: list[str], argv: list[str], out: Path, env: dict[str, str]) -> dict[str, Any]:
    """The real run in a new process: seconds from its start to the end of each step, and its cache counters."""
    spec = {"data": str(CAPYBARA), "argv": argv, "output_dir": str(out), "script_lines": script_lines}
    proc, started, seconds = _run([sys.executable, "-m", "tests.warm.real_sft", json.dumps(spec)],
                                  {**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    first = result["step_ends"][0]  # seconds after its `train()`, whose wall clock it gives
    return {"first_step": round(result["train"] + first - started, 2),
            "first_step_from_train": round(first, 2),  # after its imports
            "seconds": round(seconds, 2), "counters": result["counters"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each part; the fastest is kept")
    parser.add_argument("--json", default=None, help="also write the results here")
    opts = parser.parse_args(argv)
    run = ["--max_length", str(opts.max_length), "--per_device_train_batch_size", "2", "--max_steps", "1",
           "--torch_compile", "true"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="shapeplan-overhead-") as tmp:
        work = Path(tmp)
        plan = work / "plan.json"
        _run([sys.executable, "-m", "shapeplan", "analyze", *run_argv(CAPYBARA, run, work / "out"), "-o", str(plan)],
             {**env, "SHAPEPLAN_CACHE_DIR": str(work / "shapeplan")})
        shapes = {(s["phase"], s["batch"], s["seq"]) for s in json.loads(plan.read_text())["shapes"]}
        best: dict[str, dict[str, Any]] = {}
        for i in range(opts.repeat):
            cache = work / f"warm-cache-{i}"
            proc, _, seconds = _run([sys.executable, "-m", "shapeplan", "warm", "--plan", str(plan), "--device", "cpu",
                                     "--cache-dir", str(cache), "--json"],
                                    {**env, "SHAPEPLAN_CACHE_DIR": str(work / "shapeplan")})
            report = json.loads(proc.stdout)
            warm = {"seconds": round(seconds, 2),
                    "compile_seconds": round(sum(r["seconds"] for r in report["results"]), 2),
                    "statuses": [r["status"] for r in report["results"]]}
            cold = real_run(work / f"cold-cache-{i}", report["script_lines"], run, work / f"cold-{i}", env)
            warmed = real_run(cache, report["script_lines"], run, work / f"warmed-{i}", env)
            for part, result, key in (("warm", warm, "seconds"), ("cold", cold, "first_step"),
                                      ("warmed", warmed, "first_step")):
                if part not in best or result[key] < best[part][key]:
                    best[part] = result
            print(f"round {i + 1}: warm-up {warm['seconds']:.1f} s, cold run's first step {cold['first_step']:.1f} s "
                  f"after its start ({warm['seconds'] / cold['first_step']:.2f}x), warmed run's "
                  f"{warmed['first_step']:.1f} s", flush=True)
    warm, cold, warmed = best["warm"], best["cold"], best["warmed"]
    ratio = warm["seconds"] / cold["first_step"]
    print(f"real trl sft run, torch_compile=True, tiny model on CPU, {len(shapes)} planned shape(s)")
    print(f"warm-up (shapeplan warm, a new process)       {warm['seconds']:6.1f} s  "
          f"(its shapes' own time {warm['compile_seconds']:.1f} s: {', '.join(warm['statuses'])})")
    print(f"cold run's first step (from its start)        {cold['first_step']:6.1f} s  "
          f"({cold['first_step_from_train']:.1f} s after its imports)")
    print(f"warmed run's first step (from its start)      {warmed['first_step']:6.1f} s")
    print(f"warm-up / compile time it buys                {ratio:6.2f}x  (target <= 1.1)")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"warm": warm, "cold": cold, "warmed": warmed,
                                               "ratio": round(ratio, 2)}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
