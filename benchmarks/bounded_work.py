"""Runs a typed number cannot make unbounded (issue 22): each answered in about the time of an ordinary plan of the
same data, side by side with that plan, through the installed console script. Before, `--max_steps 1e9` and
`--num_processes 100000` ran for minutes without an answer, SHAPEPLAN_WORKERS=100000 forked thousands of processes,
and a 100,000-deep JSONL row killed the process with SIGSEGV; a run with tools and `--max_completion_length 100000`
(issue 53) exhausted memory after half a minute.

    python benchmarks/bounded_work.py [--rounds 1]

Prints per case its exit code and seconds, and its ratio to the ordinary plan's seconds (imports and tokenizing are
most of both: a ratio near 1 means the number typed cost nothing more).
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
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import CAPYBARA, TINY_MODEL  # noqa: E402  (offline environment, sample data)

SHAPEPLAN = str(Path(sys.executable).parent / "shapeplan")
BASE = ["analyze", str(CAPYBARA), "--model", str(TINY_MODEL), "--no-cache"]


def cases(folder: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    deep = folder / "deep.jsonl"
    deep.write_text(json.dumps({"text": "hello"}) + '\n{"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": json.loads(line)["messages"][:1]}) + "\n"
                               for line in CAPYBARA.read_text(encoding="utf-8").splitlines()[:4]))
    return {
        "ordinary plan (baseline)": (BASE, {}),
        "--max_steps 1000000000": ([*BASE, "--max_steps", "1000000000"], {}),
        "--num_train_epochs 1e9": ([*BASE, "--num_train_epochs", "1e9"], {}),
        "--num_processes 100000": ([*BASE, "--num_processes", "100000"], {}),
        "--num_processes 1000 --max_steps 1000": ([*BASE, "--num_processes", "1000", "--max_steps", "1000"], {}),
        "SHAPEPLAN_WORKERS=100000": (BASE, {"SHAPEPLAN_WORKERS": "100000"}),
        "100,000-deep JSONL row": (["analyze", str(deep), "--model", str(TINY_MODEL), "--no-cache"], {}),
        "--tools --max_completion_length 100000": (
            ["analyze", "--method", "grpo", str(prompts), "--model", str(TINY_MODEL), "--no-cache", "--tools",
             "tests.oracle.agentic_tools:get_weather", "--max_completion_length", "100000",
             "--cache_implementation", "static"], {}),
    }


def timed(args: list[str], env: dict[str, str]) -> tuple[int, float]:
    start = time.perf_counter()
    done = subprocess.run([SHAPEPLAN, *args], capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    return done.returncode, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="runs of every case, alternating (median kept)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        chosen = cases(Path(folder))
        seconds: dict[str, list[float]] = {name: [] for name in chosen}
        codes: dict[str, int] = {}
        for _ in range(args.rounds):  # alternating, so that the shared machine's load hits every case alike
            for name, (words, env) in chosen.items():
                codes[name], spent = timed(words, env)
                seconds[name].append(spent)
    base = median(seconds["ordinary plan (baseline)"])
    print(f"{'case':<40} {'exit':>4} {'seconds':>8} {'x baseline':>10}")
    for name in chosen:
        spent = median(seconds[name])
        print(f"{name:<40} {codes[name]:>4} {spent:>8.1f} {spent / base:>10.2f}")
    bounded = all(codes[name] != 0 and median(seconds[name]) < 3 * base + 10 for name in chosen
                  if name != "ordinary plan (baseline)")
    print("every case refused in about an ordinary plan's time" if bounded else "SOME CASE TOOK LONGER OR EXITED 0")
    return 0 if bounded else 1


if __name__ == "__main__":
    sys.exit(main())
