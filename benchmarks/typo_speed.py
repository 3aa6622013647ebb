"""How fast a mistyped option is refused, next to TRL's own refusal, and how fast a `--config` run is answered again.

Each part runs the installed console script in a fresh process, REPEAT times, and reports the median wall seconds
(interpreter start and imports included: that is what a user waits for), side by side on the same host:

  trl-typo        `trl sft --config C --max_lenght 512` (TRL's parser, then accelerate's, refuses it)
  typo            `shapeplan analyze --config C --max_lenght 512` (refused naming --max_length)
  own-typo        `shapeplan warm --config C --cache_dir D` (refused naming --cache-dir, before TRL is imported)
  config-cached   `shapeplan analyze --config C --json` run again (answered from the plan cache)
  flags-cached    the same run given as flags, run again

C names the bundled tiny model and sample data. Usage:

  python benchmarks/typo_speed.py [--repeat 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "tiny-qwen3"
DATA = ROOT / "examples" / "capybara-sample.jsonl"
BIN = Path(sys.executable).parent


def _seconds(argv: list[str], env: dict[str, str], code: int) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != code:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}, not {code}: {done.stderr[-500:]}")
    return elapsed


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, metavar="FILE")
    opts = parser.parse_args(args)
    with tempfile.TemporaryDirectory(prefix="typo-speed-") as folder:
        work = Path(folder)
        config = work / "sft.yaml"
        config.write_text(f"model_name_or_path: {MODEL}\ndataset_name: {DATA}\nmax_length: 256\nmax_steps: 5\n"
                          "use_cpu: true\n")  # else `trl sft` refuses its default bf16 before it reads the typo
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SHAPEPLAN_CACHE_DIR": str(work / "cache"),
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        shapeplan, trl = str(BIN / "shapeplan"), shutil.which("trl", path=str(BIN)) or "trl"
        flags = ["--dataset_name", str(DATA), "--model_name_or_path", str(MODEL), "--max_length", "256",
                 "--max_steps", "5"]
        parts = {
            "trl-typo": ([trl, "sft", "--config", str(config), "--max_lenght", "512"], 2),
            "typo": ([shapeplan, "analyze", "--config", str(config), "--max_lenght", "512"], 2),
            "own-typo": ([shapeplan, "warm", "--config", str(config), "--cache_dir", str(work / "c")], 2),
            "config-cached": ([shapeplan, "analyze", "--config", str(config), "--json"], 0),
            "flags-cached": ([shapeplan, "analyze", *flags, "--json"], 0),
        }
        for name in ("config-cached", "flags-cached"):  # the first run fills the plan cache
            _seconds(parts[name][0], env, 0)
        results = {name: statistics.median(_seconds(argv, env, code) for _ in range(opts.repeat))
                   for name, (argv, code) in parts.items()}
    for name, seconds in results.items():
        print(f"{name:<14} {seconds:6.2f} s")
    print(f"typo / trl-typo: {results['typo'] / results['trl-typo']:.2f}   "
          f"config-cached / flags-cached: {results['config-cached'] / results['flags-cached']:.2f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
