"""`shapeplan advise` against one cold `shapeplan analyze` on the same rows: every alternative re-plans from one
tokenization, so advise should cost at most 2x the cold analyze (issue 16).

Makes ROWS conversational rows as `analyze_speed.py` does (examples/capybara-sample.jsonl, words re-drawn), then
times, each in a fresh process with an empty shapeplan cache and imports done before the clock:

  analyze   `shapeplan.services.analyze.analyze("sft", ...)`: loading, tokenizing, batch order, plan
  advise    `shapeplan.services.advise.advise("sft", ...)`: the lengths, the baseline and every alternative, costed

Usage: python benchmarks/advise_speed.py [--rows 100000] [--max-length 1024] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analyze_speed import ROOT, Clock, analyze_argv, make_rows


def _imports() -> None:
    import datasets  # noqa: F401
    import transformers.training_args  # noqa: F401
    import trl.scripts.sft  # noqa: F401
    from trl import SFTConfig, SFTTrainer  # noqa: F401

    import shapeplan.adapters.sft  # noqa: F401


def part(name: str, data: Path, max_length: int) -> dict[str, Any]:
    _imports()
    argv = [*analyze_argv(data, max_length), "--per_device_train_batch_size", "8"]
    if name == "analyze":
        from shapeplan.services.analyze import analyze

        with Clock() as clock:
            plan = analyze("sft", argv)
        return clock.result(shapes=len(plan.shapes))
    from shapeplan.services.advise import advise

    with Clock() as clock:
        advice = advise("sft", argv)
    return clock.result(alternatives=len(advice.options), skipped=len(advice.skipped))


def run(name: str, data: Path, max_length: int, env: dict[str, str], cache: Path) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, __file__, "--part", name, "--data", str(data), "--max-length",
                        str(max_length), "--out", out.name], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       env={**env, "SHAPEPLAN_CACHE_DIR": str(cache)})
        result: dict[str, Any] = json.loads(Path(out.name).read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument("--part", choices=("analyze", "advise"), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        sys.path.insert(0, str(ROOT))  # this checkout's shapeplan
        Path(args.out).write_text(json.dumps(part(args.part, args.data, args.max_length)))
        return 0
    with tempfile.TemporaryDirectory(prefix="shapeplan-bench-") as tmp:
        work = Path(tmp)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(work / "datasets"), "PYTHONPATH": str(ROOT),
               "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        data = work / "conversational.jsonl"
        make_rows("conversational", args.rows, data)
        run("analyze", data, args.max_length, env, work / "warmup")  # converts the JSON to Arrow, untimed
        results = {name: run(name, data, args.max_length, env, work / f"cache-{name}")
                   for name in ("analyze", "advise")}
    ratio = results["advise"]["seconds"] / results["analyze"]["seconds"]
    print(f"{args.rows} conversational rows, max_length {args.max_length}, {os.cpu_count()} cores")
    print(f"  cold analyze {results['analyze']['seconds']:.2f} s; advise {results['advise']['seconds']:.2f} s "
          f"({results['advise']['alternatives']} alternatives planned, {results['advise']['skipped']} refused): "
          f"{ratio:.2f}x (target <= 2)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**results, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
