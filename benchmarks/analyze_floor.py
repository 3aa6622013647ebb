"""`shapeplan analyze` against the tokenizer's floor, whole commands side by side in one run, cold caches.

For each row count (conversational rows made from examples/capybara-sample.jsonl, every row's words re-drawn, as
benchmarks/analyze_speed.py makes them), each in a fresh process, wall clock from the interpreter's start:

  floor      import transformers, load the tokenizer (examples/tiny-qwen3), read the rows (json), render them with
             `apply_chat_template(..., tokenize=False)` 1,024 conversations a call, tokenize each batch with the Rust
             tokenizer's `encode_batch_fast`, keep the lengths
  analyze    `shapeplan analyze FILE --model M --json --no-cache`, with empty datasets and shapeplan caches (the
             JSON file converted to Arrow, TRL's parser, the lengths, the batch order, the plan)

and, for the small-run target, `analyze` on 200 rows against `tokenizer` (import transformers, load the tokenizer,
nothing else), and the same `analyze` as the first run after an install ("first run": TRL's config defaults not yet
read; `analyze` reads them once through TRL's parser, trl-defaults/ under the cache root, as Python compiles its .pyc
files once). Every timed `analyze` gets empty datasets and shapeplan caches but the defaults file, read before the
clock by one untimed run. Prints seconds, ratios and peak RSS (`os.wait4`). Usage:

  python benchmarks/analyze_floor.py [--rows 10000,100000] [--small 200] [--repeat 1] [--json out.json]

Targets (issue #57): analyze / floor <= 1.0 at 100,000 rows; analyze(200 rows) / tokenizer <= 1.5.
`--rows ""` runs the small comparison alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "tiny-qwen3"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from analyze_speed import make_rows  # noqa: E402  # the same rows as the in-process benchmark

FLOOR = """
import json, sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
rows = [json.loads(line)["messages"] for line in open(sys.argv[1], encoding="utf-8")]
lengths = []
for start in range(0, len(rows), 1024):
    texts = tokenizer.apply_chat_template(rows[start:start + 1024], tokenize=False)
    lengths += [len(e) for e in tokenizer._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
print(sum(lengths))
"""
TOKENIZER = "import sys\nfrom transformers import AutoTokenizer\nAutoTokenizer.from_pretrained(sys.argv[1])\n"
DEFAULTS = "trl-defaults"  # TRL's config defaults as analyze reads them once (shapeplan/adapters/trl_args.py)


def timed(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Wall seconds and peak RSS (MiB) of `command` in a fresh process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    stderr = process.stderr.read() if process.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command[:4])} ... failed: {stderr[-2000:]}")
    return {"seconds": round(seconds, 2), "rss_mib": round(usage.ru_maxrss / 1024)}


def analyze(data: Path, folder: Path, env: dict[str, str], defaults: Path | None) -> dict[str, Any]:
    """`analyze` with empty caches but, from `defaults` (a cache root), TRL's config defaults as read once."""
    if defaults is not None and (defaults / DEFAULTS).is_dir():
        shutil.copytree(defaults / DEFAULTS, folder / "shapeplan" / DEFAULTS)
    cold = {**env, "SHAPEPLAN_CACHE_DIR": str(folder / "shapeplan"), "HF_DATASETS_CACHE": str(folder / "datasets")}
    return timed([sys.executable, "-m", "shapeplan", "analyze", str(data), "--model", str(MODEL), "--json",
                  "--no-cache"], cold)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="10000,100000", help="comma-separated row counts")
    parser.add_argument("--small", type=int, default=200, help="the small run's rows")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each part; the fastest is kept")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shapeplan-floor-") as tmp:
        folder = Path(tmp)
        small = folder / "small.jsonl"
        make_rows("conversational", args.small, small)
        installed = folder / "installed"  # the first run after an install, which reads TRL's defaults once
        first = analyze(small, installed, env, None)
        for rows in [int(r) for r in args.rows.split(",") if r]:
            data = folder / f"rows-{rows}.jsonl"
            make_rows("conversational", rows, data)
            best: dict[str, dict[str, Any]] = {}
            for i in range(args.repeat):  # the two side by side, in turn
                for part in ("floor", "analyze"):
                    result = timed([sys.executable, "-c", FLOOR, str(data), str(MODEL)], env) if part == "floor" \
                        else analyze(data, folder / f"cold-{rows}-{i}", env, installed / "shapeplan")
                    if part not in best or result["seconds"] < best[part]["seconds"]:
                        best[part] = result
            ratio = best["analyze"]["seconds"] / best["floor"]["seconds"]
            results[str(rows)] = {**best, "ratio": round(ratio, 2)}
            floor, planned = best["floor"], best["analyze"]
            print(f"{rows:>9,} rows  floor {floor['seconds']:7.2f} s  analyze {planned['seconds']:7.2f} s"
                  f"  analyze/floor {ratio:.2f}  (RSS MiB: floor {floor['rss_mib']}, analyze {planned['rss_mib']})",
                  flush=True)
        best = {}
        for i in range(args.repeat):  # side by side, in turn
            for part in ("tokenizer", "analyze", "first run"):
                result = timed([sys.executable, "-c", TOKENIZER, str(MODEL)], env) if part == "tokenizer" else \
                    analyze(small, folder / f"cold-small-{i}", env, installed / "shapeplan") if part == "analyze" \
                    else analyze(small, folder / f"first-small-{i}", env, None)
                if part not in best or result["seconds"] < best[part]["seconds"]:
                    best[part] = result
        ratio = best["analyze"]["seconds"] / best["tokenizer"]["seconds"]
        first_ratio = best["first run"]["seconds"] / best["tokenizer"]["seconds"]
        results["small"] = {"rows": args.small, "tokenizer": best["tokenizer"], "analyze": best["analyze"],
                            "ratio": round(ratio, 2), "first_run": best["first run"],
                            "first_run_ratio": round(first_ratio, 2), "untimed_first": first}
        print(f"{args.small:>9,} rows  tokenizer load {best['tokenizer']['seconds']:.2f} s  analyze "
              f"{best['analyze']['seconds']:.2f} s  analyze/tokenizer {ratio:.2f}  (first run after an install "
              f"{best['first run']['seconds']:.2f} s, {first_ratio:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
