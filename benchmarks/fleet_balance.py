"""How evenly `warm --shard I/N` spreads a plan, and what 3 shards save against 1 process.

Balance: the costliest shard's estimated compile minutes over the mean shard's (and over the lower bound of any
split) for N = 2, 3, 4, 8, 16 and random plans of at least 3N tasks: GRPO (3N or more generate sizes of 12 + C
minutes, C its completion buckets, and 1-minute train shapes), SFT (1-minute shapes) and mixed (any share of
generate sizes). The split is what every shard computes (`shards.shard_tasks`). Exit 1 if a GRPO plan's exceeds
1.25.
Wall time: on CPU (Inductor, torch_compile, the tiny model), one plan of 6 shapes warmed by 1 process, then by 3
concurrent shard processes on one shared cache dir, each into a fresh cache dir.

    python benchmarks/fleet_balance.py [--plans 200] [--no-wall]
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shapeplan.warm.model import WarmTask  # noqa: E402
from shapeplan.warm.rounds import GenerateTask  # noqa: E402
from shapeplan.warm.shards import Shard, shard_tasks, task_cost  # noqa: E402
from tests.conftest import CAPYBARA  # noqa: E402  (offline environment, sample data)
from tests.warm.harness import run_argv  # noqa: E402

COUNTS = (2, 3, 4, 8, 16)
# the plan of tests/warm/test_fleet.py: train and eval shapes at 128, 256 and 384
WALL_ARGV = ["--max_length", "384", "--per_device_train_batch_size", "1", "--per_device_eval_batch_size", "1",
             "--max_steps", "8", "--eval_strategy", "steps", "--eval_steps", "8", "--torch_compile", "true"]


def grpo_plan(rng: random.Random, count: int) -> list[WarmTask | GenerateTask]:
    """3N to 6N generate sizes (12 + C minutes each, C in 0..4) and up to as many 1-minute train shapes."""
    sizes = rng.randint(3 * count, 6 * count)
    tasks: list[WarmTask | GenerateTask] = [
        GenerateTask("generate", 8, 128 * (i + 1), None, 256, tuple(range(rng.randint(0, 4)))) for i in range(sizes)]
    return tasks + [WarmTask("train", 8, 128 * (i + 1)) for i in range(rng.randint(0, sizes))]


def sft_plan(rng: random.Random, count: int) -> list[WarmTask | GenerateTask]:
    """3N to 6N 1-minute shapes."""
    return [WarmTask(rng.choice(("train", "eval")), rng.choice((1, 2, 4, 8)), 128 * i)
            for i in range(1, rng.randint(3 * count, 6 * count) + 1)]


def mixed_plan(rng: random.Random, count: int) -> list[WarmTask | GenerateTask]:
    """3N to 6N tasks of which any number (at least one) are generate sizes."""
    size = rng.randint(3 * count, 6 * count)
    generate = rng.randint(1, size)
    tasks: list[WarmTask | GenerateTask] = [
        GenerateTask("generate", 8, 128 * (i + 1), None, 256, tuple(range(rng.randint(0, 4))))
        for i in range(generate)]
    return tasks + [WarmTask("train", 8, 128 * (i + 1)) for i in range(size - generate)]


FAMILIES = {"grpo": grpo_plan, "sft": sft_plan, "mixed": mixed_plan}


def balance(tasks: list[WarmTask | GenerateTask], count: int) -> tuple[float, float]:
    """The costliest shard over the mean shard, and over the lower bound of any split (the mean, or the largest
    task when one task outweighs a mean share)."""
    loads = [sum(task_cost(t)[0] for t in shard_tasks(tasks, Shard(i, count, "--shard"))) for i in range(count)]
    mean = sum(loads) / count
    return max(loads) / mean, max(loads) / max(mean, max(task_cost(t)[0] for t in tasks))


def wall(tmp: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES": "0"}
    shapeplan = str(Path(sys.executable).parent / "shapeplan")
    plan = tmp / "plan.json"
    subprocess.run([shapeplan, "analyze", *run_argv(CAPYBARA, WALL_ARGV, tmp / "out"), "--eval-dataset",
                    str(CAPYBARA), "-o", str(plan)], env=env, check=True, capture_output=True)
    warm = [shapeplan, "warm", "--plan", str(plan), "--device", "cpu", "--json"]
    start = time.perf_counter()
    subprocess.run([*warm, "--cache-dir", str(tmp / "one")], env=env, check=True, capture_output=True)
    one = time.perf_counter() - start
    start = time.perf_counter()
    procs = [subprocess.Popen([*warm, "--cache-dir", str(tmp / "shared"), "--shard", f"{i}/3"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for i in range(3)]
    for proc in procs:
        proc.communicate()
        if proc.returncode:
            sys.exit(f"a shard failed with exit code {proc.returncode}")
    three = time.perf_counter() - start
    return {"shapes": len(json.loads(plan.read_text())["shapes"]), "one_process_s": one, "three_shards_s": three}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=200, help="random plans per shard count")
    parser.add_argument("--no-wall", action="store_true", help="only the balance (no compile)")
    args = parser.parse_args(argv)
    rng = random.Random(15)
    worst_grpo = 0.0
    print("| plans (>= 3N tasks) | shards N | plans | mean max/mean | worst max/mean | worst max/lower bound |")
    print("| --- | --- | --- | --- | --- | --- |")
    for family, make in FAMILIES.items():
        for count in COUNTS:
            ratios = [balance(make(rng, count), count) for _ in range(args.plans)]
            over_mean = [r[0] for r in ratios]
            if family == "grpo":
                worst_grpo = max(worst_grpo, *over_mean)
            print(f"| {family} | {count} | {len(ratios)} | {sum(over_mean) / len(ratios):.3f} | "
                  f"{max(over_mean):.3f} | {max(r[1] for r in ratios):.3f} |")
    if not args.no_wall:
        with tempfile.TemporaryDirectory(prefix="shapeplan-fleet-bench-") as folder:
            result = wall(Path(folder))
        print(f"\nwall, {result['shapes']} shapes on CPU (Inductor): 1 process {result['one_process_s']:.1f} s, "
              f"3 shards {result['three_shards_s']:.1f} s ({result['one_process_s'] / result['three_shards_s']:.2f}x)")
    return 0 if worst_grpo <= 1.25 else 1


if __name__ == "__main__":
    sys.exit(main())
