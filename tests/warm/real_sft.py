"""A real `trl sft` run in its own process, set up as `shapeplan warm` tells a training script to be.

    python -m tests.warm.real_sft SPEC_JSON

SPEC_JSON: {"data": path, "argv": [TRL options], "output_dir": path, "script_lines": [lines from the warm report]};
with "vision": true, the data's rows have images and the run is the vision oracle's (the bundled tiny Qwen2.5-VL).
TORCHINDUCTOR_CACHE_DIR comes from the environment. Prints one JSON line: the compile cache counters, the seconds
from `train()` to the end of each optimizer step, and the wall clock (time.time) at `train()`, which a parent that
timed the process's start reads the steps against.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import tests.conftest  # noqa: F401  (offline environment)
from tests.warm.harness import real_run


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import TrainerCallback

    for line in spec["script_lines"]:
        if line.startswith("torch."):  # the training-script lines, run as the user would paste them
            exec(line, {"torch": torch})

    start, train = time.perf_counter(), time.time()
    step_ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            step_ends.append(round(time.perf_counter() - start, 3))

    if spec.get("vision"):
        from tests.oracle.vision_harness import run_sft_vision

        model = {"model": Path(spec["model"])} if spec.get("model") else {}  # else the bundled tiny Qwen2.5-VL
        run_sft_vision(Path(spec["data"]), spec["argv"], guarded=False, **model)
    else:
        real_run("sft", Path(spec["data"]), spec["argv"], Path(spec["output_dir"]), callbacks=[Clock()])
    out = {"counters": {f"{g}.{k}": int(v) for g in ("inductor", "aot_autograd") for k, v in counters[g].items()},
           "step_ends": step_ends, "train": train}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
