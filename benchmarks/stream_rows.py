"""What `shapeplan analyze --dataset_streaming` reads of a long stream, and its peak memory.

Writes ROWS short plain-text rows (1 to 24 words) to a JSONL file in a temporary folder, then plans a streaming SFT
run of `--max_steps STEPS` on it, each part in a fresh process:

  stream          unpacked rows, batch 8: the run consumes STEPS x 8 rows
  stream-packing  bfd packing at max_length 1024, batch 8: the run consumes STEPS x 8 packed rows, packed by TRL
                  from whole 1000-row pack batches
The same two plans run on streams of every size in SIZES: the rows read and the peak memory must not grow with
the stream (datasets' JSON reader parses the file in blocks of about 10 MB, so a stream smaller than a block costs a
little less).

Rows read are counted where planning pulls them from the datasets iterator (`shapeplan.adapters.stream.Reader`); the
plan records the count in its streaming warning. Peak RSS is the process's own (`os.wait4`). Usage:

  python benchmarks/stream_rows.py [--sizes 100000,1000000,2000000] [--steps 100] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "tiny-qwen3"
BATCH = 8
CONFIGS = {"stream": [], "stream-packing": ["--packing", "--max_length", "1024"]}

_CHILD = """
import json, sys, time
from shapeplan.services.analyze import analyze
start = time.perf_counter()
plan = analyze("sft", sys.argv[2:], use_cache=False)
with open(sys.argv[1], "w") as f:
    json.dump({"seconds": time.perf_counter() - start, "rows": plan.stats.rows, "warnings": list(plan.warnings)}, f)
"""


def make_rows(path: Path, rows: int) -> None:
    rng = random.Random(rows)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "owls", "watch"]
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(1, 24)))}) + "\n")


def run_part(data: Path, extra: list[str], steps: int) -> dict[str, Any]:
    """Plan in a fresh interpreter; what it read, its time, and its peak RSS."""
    argv = ["--dataset_name", str(data), "--model_name_or_path", str(MODEL), "--dataset_streaming",
            "--max_steps", str(steps), "--per_device_train_batch_size", str(BATCH), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with tempfile.NamedTemporaryFile(suffix=".json") as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen([sys.executable, "-c", _CHILD, out.name, *argv], cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise SystemExit(f"analyze failed:\n{err.read().decode()[-3000:]}")
        result = json.loads(Path(out.name).read_text())
    read = next(m for w in result["warnings"] if (m := re.search(r"\((\d+) source rows read", w)))
    return {"seconds": round(result["seconds"], 2), "prepared_rows": result["rows"], "rows_read": int(read.group(1)),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000,1000000,2000000", help="stream sizes in rows, comma-separated")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shapeplan-stream-bench-") as tmp:
        for rows in map(int, args.sizes.split(",")):
            data = Path(tmp) / f"rows-{rows}.jsonl"
            start = time.perf_counter()
            make_rows(data, rows)
            print(f"wrote {rows} rows ({data.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - start:.1f} s",
                  flush=True)
            for name, extra in CONFIGS.items():
                part = run_part(data, extra, args.steps)
                results[f"{name}@{rows}"] = part
                print(f"{name} on {rows} rows: {json.dumps(part)}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
