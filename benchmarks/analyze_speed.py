"""How fast `shapeplan analyze` finds prepared SFT row lengths, next to TRL's preparation and the tokenizer's floor.

Makes ROWS conversational rows (from examples/capybara-sample.jsonl) and ROWS prompt-completion rows (from
examples/tldr-sample.jsonl), each row's words re-drawn so no two rows are the same text, then times, each part in a
fresh process on the same rows and tokenizer (examples/tiny-qwen3, a small byte-level BPE):

  floor      render every row with `apply_chat_template(..., tokenize=False)` (prompt-completion: concatenate), then
             one batched `tokenizer(texts, add_special_tokens=False)` call
  trl        `SFTTrainer._prepare_dataset` on a bare trainer, as `shapeplan.adapters.sft` used to plan with
  analyze    `shapeplan.services.analyze.analyze("sft", ...)` with an empty length cache (loading, lengths, batch
             order, plan)
  cached     the same call again on the same caches (`analyze` answers it from the plan cache)
  cli-cached `python -m shapeplan analyze ... --json` run twice; the second, wall clock with interpreter start

Each part reads a dataset datasets has already converted to Arrow (conversion is not timed) and reports the time of
its work and the peak RSS of its largest process (`os.wait4`). Usage:

  python benchmarks/analyze_speed.py [--rows 100000] [--max-length 1024] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "tiny-qwen3"
SOURCES = {"conversational": ROOT / "examples" / "capybara-sample.jsonl",
           "prompt-completion": ROOT / "examples" / "tldr-sample.jsonl"}
PARTS = ("floor", "trl", "analyze", "cached", "cli-cached")


def _redraw(text: str, rng: random.Random) -> str:
    """The same words in a new order, 60% to 140% as many: a new text with the sample's token statistics."""
    words = text.split()
    if not words:
        return text
    n = max(1, round(len(words) * rng.uniform(0.6, 1.4)))
    return " ".join(rng.choice(words) for _ in range(n))


def make_rows(kind: str, rows: int, path: Path) -> None:
    samples = [json.loads(line) for line in SOURCES[kind].read_text().splitlines()]
    rng = random.Random(rows)
    with path.open("w") as f:
        for i in range(rows):
            sample = samples[i % len(samples)]
            if kind == "conversational":
                row: dict[str, Any] = {"messages": [{"role": m["role"], "content": _redraw(m["content"], rng)}
                                                    for m in sample["messages"]]}
            else:
                head, _, post = sample["prompt"].partition("POST: ")
                row = {"prompt": f"{head}POST: {_redraw(post, rng)}", "completion": " " + _redraw(
                    sample["completion"], rng)}
            f.write(json.dumps(row) + "\n")


def analyze_argv(data: Path, max_length: int) -> list[str]:
    return ["--dataset_name", str(data), "--model_name_or_path", str(MODEL), "--max_length", str(max_length)]


# ---- parts: each runs in its own process (`--part NAME`) and writes {"seconds": ...} to --out ----
# Imports come before the clock starts in every part: they cost the same whatever the dataset's size.


class Clock:
    """Wall and CPU seconds (this process and the workers it waited for) of a `with` block."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), _cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, _cpu() - self.cpu

    def result(self, **extra: Any) -> dict[str, Any]:
        return {"seconds": self.wall, "cpu_seconds": self.cpu, **extra}


def _cpu() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

def part_load(data: Path, max_length: int) -> dict[str, Any]:
    import datasets

    dataset = datasets.load_dataset("json", data_files=str(data), split="train")
    return {"rows": len(dataset)}


def part_floor(data: Path, max_length: int) -> dict[str, Any]:
    import datasets
    from transformers import AutoTokenizer

    dataset = datasets.load_dataset("json", data_files=str(data), split="train")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    with Clock() as clock:
        if "messages" in dataset.column_names:
            texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in dataset["messages"]]
        else:
            texts = [p + c for p, c in zip(dataset["prompt"], dataset["completion"], strict=True)]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return clock.result(tokens=sum(map(len, ids)))


def part_trl(data: Path, max_length: int) -> dict[str, Any]:
    import datasets

    from shapeplan.adapters.data import load_tokenizer
    from shapeplan.adapters.sft import _bare_trainer
    from shapeplan.adapters.trl_args import parse_training_args
    from shapeplan.services.trainers import TRAINERS

    config = parse_training_args(TRAINERS["sft"], analyze_argv(data, max_length)).training
    dataset = datasets.load_dataset("json", data_files=str(data), split="train")
    tokenizer = load_tokenizer(str(MODEL))
    with Clock() as clock:
        trainer = _bare_trainer(tokenizer, config, dataset[0])
        prepared = trainer._prepare_dataset(dataset, tokenizer, config, False, None, "train")
    return clock.result(rows=len(prepared))


def part_analyze(data: Path, max_length: int) -> dict[str, Any]:
    # What analyze imports on its way, before the clock as in the other parts (TRL's config pulls in torch).
    import datasets  # noqa: F401
    import transformers.training_args  # noqa: F401
    import trl.scripts.sft  # noqa: F401
    from trl import SFTConfig, SFTTrainer  # noqa: F401

    import shapeplan.adapters.sft  # noqa: F401
    from shapeplan.services.analyze import analyze

    with Clock() as clock:
        plan = analyze("sft", analyze_argv(data, max_length))
    return clock.result(shapes=len(plan.shapes))


PART_FUNCTIONS = {"load": part_load, "floor": part_floor, "trl": part_trl, "analyze": part_analyze,
                  "cached": part_analyze}


def run_part(part: str, data: Path, max_length: int, env: dict[str, str]) -> dict[str, Any]:
    """Run one part in a fresh interpreter; its result, and the peak RSS of its largest process."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, __file__, "--part", part, "--data", str(data), "--max-length", str(max_length),
                   "--out", out.name]
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert process.stderr is not None
        stderr = process.stderr.read()
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            raise SystemExit(f"part {part} failed:\n{stderr.decode()[-3000:]}")
        result: dict[str, Any] = json.loads(Path(out.name).read_text())
    result["peak_rss_mb"] = usage.ru_maxrss / 1024
    return result


def cli_wall_seconds(data: Path, max_length: int, env: dict[str, str]) -> float:
    """The second of two identical command lines, timed whole: what a user waits for on an unchanged re-run."""
    command = [sys.executable, "-m", "shapeplan", "analyze", "--json", *analyze_argv(data, max_length)]
    for _ in range(2):
        start = time.perf_counter()
        subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000, help="rows of each dataset (default 100000)")
    parser.add_argument("--max-length", type=int, default=1024, help="SFT max_length (default: TRL's 1024)")
    parser.add_argument("--kinds", default="conversational,prompt-completion")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)}")
    parser.add_argument("--workers", default=None, help="SHAPEPLAN_WORKERS for analyze (default: one per core)")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results to this file")
    parser.add_argument("--part", choices=sorted(PART_FUNCTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.part:
        sys.path.insert(0, str(ROOT))  # this checkout's shapeplan, whatever is installed
        result = PART_FUNCTIONS[args.part](args.data, args.max_length)
        Path(args.out).write_text(json.dumps(result))
        return 0

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="shapeplan-bench-") as tmp:
        work = Path(tmp)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(work / "datasets"), "SHAPEPLAN_CACHE_DIR": str(work / "shapeplan"),
               "PYTHONPATH": str(ROOT), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
        if args.workers:
            env["SHAPEPLAN_WORKERS"] = args.workers
        for kind in args.kinds.split(","):
            data = work / f"{kind}.jsonl"
            make_rows(kind, args.rows, data)
            run_part("load", data, args.max_length, env)
            parts: dict[str, dict[str, Any]] = {}
            for part in args.parts.split(","):
                if part == "cli-cached":
                    parts[part] = {"seconds": cli_wall_seconds(data, args.max_length, env)}
                else:
                    parts[part] = run_part(part, data, args.max_length, env)
            results[kind] = parts
            report(kind, args.rows, parts)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


def report(kind: str, rows: int, parts: dict[str, dict[str, Any]]) -> None:
    base = parts.get("floor", parts[next(iter(parts))])
    floor, cpu_floor = base["seconds"], base.get("cpu_seconds", 1.0)
    tokens = f", {base['tokens'] / rows:.0f} tokens per row" if "tokens" in base else ""
    against = "floor" if "floor" in parts else next(iter(parts))
    print(f"\n{kind}: {rows} rows{tokens}, {os.cpu_count()} cores; x {against}: time relative to {against}")
    print(f"  {'part':<11} {'seconds':>8} {'x ' + against:>8} {'cpu s':>8} {'x ' + against:>8} {'peak RSS MB':>12}")
    for name, part in parts.items():
        rss = f"{part['peak_rss_mb']:12.0f}" if "peak_rss_mb" in part else f"{'':>12}"
        cpu = f"{part['cpu_seconds']:8.2f} {part['cpu_seconds'] / cpu_floor:8.2f}" if "cpu_seconds" in part \
            else f"{'':>8} {'':>8}"
        print(f"  {name:<11} {part['seconds']:8.2f} {part['seconds'] / floor:8.2f} {cpu} {rss}")
    if {"floor", "trl", "analyze", "cached", "cli-cached"} <= set(parts):
        analyze_s, trl_s = parts["analyze"]["seconds"], parts["trl"]["seconds"]
        print(f"  analyze / floor = {analyze_s / floor:.2f} (target <= 1.2); trl / analyze = {trl_s / analyze_s:.2f} "
              f"(target >= 2); cached re-run {parts['cached']['seconds']:.2f} s in process, "
              f"{parts['cli-cached']['seconds']:.2f} s from the command line with interpreter start and imports "
              "(target <= 2 s)")


if __name__ == "__main__":
    sys.exit(main())
