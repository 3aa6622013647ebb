"""How close `shapeplan advise --calibrate` predicts a real run: on CPU with the bundled tiny model and Inductor.

1. plan a small `trl sft` run with torch_compile=True and warm it into a fresh Inductor cache (`shapeplan warm
   --device cpu`), which records per shape its compile seconds and steady-state seconds in the manifest;
2. `shapeplan advise --calibrate CACHE --json` on the same run: the baseline's predicted compile and training
   seconds;
3. the real run (TRL's parser and SFTTrainer, tests/warm/real_sft.py) in a new process, once on an empty cache
   (compiles + steps: against the predicted total) and once on the warmed cache (steps only: against the
   predicted training seconds). Target: within 25%.

    python benchmarks/advise_calibration.py [--max-length 512] [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from warm_speedup import ROOT, _run, real_run

from tests.conftest import CAPYBARA
from tests.warm.harness import run_argv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--json", dest="json_out", default=None)
    opts = parser.parse_args(argv)
    argv = ["--max_length", str(opts.max_length), "--per_device_train_batch_size", "2", "--max_steps",
            str(opts.steps), "--torch_compile", "true", "--logging_steps", "1000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES": "0"}
    work = Path(tempfile.mkdtemp(prefix="shapeplan-bench-"))
    run = run_argv(CAPYBARA, argv, work / "out")
    plan = work / "plan.json"
    _run([sys.executable, "-m", "shapeplan", "analyze", *run, "-o", str(plan)], env)
    warmed = _run([sys.executable, "-m", "shapeplan", "warm", "--plan", str(plan), "--device", "cpu",
                   "--cache-dir", str(work / "warm-cache"), "--json"], env)
    lines = json.loads(warmed.stdout)["script_lines"]
    advised = _run([sys.executable, "-m", "shapeplan", "advise", *run, "--calibrate", str(work / "warm-cache"),
                    "--json"], env)
    baseline = json.loads(advised.stdout)["baseline"]
    cold = real_run(work / "cold-cache", lines, argv, work / "cold", env)["step_ends"][-1]
    warm = real_run(work / "warm-cache", lines, argv, work / "warm", env)["step_ends"][-1]
    predicted_total, predicted_train = baseline["total_seconds"], baseline["train_seconds"]
    results = {"shapes": baseline["shapes_per_phase"], "steps": opts.steps,
               "predicted_total_s": predicted_total, "measured_cold_s": cold,
               "predicted_train_s": predicted_train, "measured_warm_s": warm}
    print(f"real trl sft, torch_compile, tiny model on CPU: {opts.steps} steps, shapes {baseline['shapes_per_phase']}")
    print(f"  cold cache: predicted {predicted_total:.1f} s (compile + train), measured {cold:.1f} s: "
          f"{predicted_total / cold - 1:+.0%}")
    print(f"  warm cache: predicted {predicted_train:.1f} s (train), measured {warm:.1f} s: "
          f"{predicted_train / warm - 1:+.0%}")
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
