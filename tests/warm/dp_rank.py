"""One rank of a data-parallel warm-up or real run under `accelerate launch`, recording what it dispatches.

    accelerate launch --num_processes N ... -m tests.warm.dp_rank SPEC_JSON

SPEC_JSON: {"mode": "warm" | "real", "out": path prefix, "device_ops": bool, "script_lines": [...], and for
"warm": "plan", "cache"; for "real": "method", "data", "argv", "output_dir"}. "warm" runs `shapeplan warm --plan
PLAN --device cpu --cache-dir CACHE --json` (its report on stdout), "real" a real `trl <method>` run built as
tests/warm/harness.py `real_run` builds it (the generation trainers: tests/warm/grpo_harness.py `real_run`). Each
rank writes OUT.RANK.pickle: {"signatures": the device-op signatures it dispatched (tests/warm/placement.py; with
"device_ops"), "objects": those of its object gathers, "counters": the Inductor/AOTAutograd cache counters}.
"script_lines" are the warm report's training-script lines, run before a real run.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import sys
from pathlib import Path

import tests.conftest  # noqa: F401  (offline environment)
from shapeplan.services.trainers import TRAINERS
from tests.oracle.harness import end_rank
from tests.warm import grpo_harness, harness
from tests.warm.placement import DeviceOpRecorder, tracking


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch
    from torch._dynamo.utils import counters

    for line in spec.get("script_lines", ()):
        if line.startswith("torch."):  # the training-script lines, run as the user would paste them
            exec(line, {"torch": torch})
    recorder = DeviceOpRecorder()
    method = spec.get("method") or json.loads(Path(spec["plan"]).read_text())["method"]
    generates = TRAINERS[method].generates
    # TRL's collators (and the generation trainers' prompt/completion tensors) pad on the host (`pad` allocates
    # where its inputs are)
    pad_modules = grpo_harness.PAD_MODULES if generates else (f"trl.trainer.{method}_trainer",)
    recording = (tracking(recorder, *map(importlib.import_module, pad_modules))
                 if spec["device_ops"] else contextlib.nullcontext())
    code = 0
    with recording:
        if spec["mode"] == "warm":
            from shapeplan.cli import main as shapeplan

            code = shapeplan(["warm", "--plan", spec["plan"], "--device", "cpu", "--cache-dir", spec["cache"],
                              "--json"])
        else:
            (grpo_harness if generates else harness).real_run(method, Path(spec["data"]), spec["argv"],
                                                              Path(spec["output_dir"]))
    out = {"signatures": recorder.signatures, "objects": recorder.objects,
           "counters": {f"{g}.{k}": int(v) for g in ("inductor", "aot_autograd") for k, v in counters[g].items()}}
    Path(f"{spec['out']}.{os.environ['RANK']}.pickle").write_bytes(pickle.dumps(out))
    end_rank(code)


if __name__ == "__main__":
    main()
