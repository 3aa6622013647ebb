"""What the guard costs a training step: the same real `SFTTrainer` run on CPU with the bundled tiny model, without
and with `ShapeGuard` (its own exact plan, `warn`, a run record), side by side in one invocation, alternating so that
the shared machine's load hits both alike. Prints the median step time of each (the first steps are left out: they
build the optimizer state) and the overhead. On a shared machine the step times vary by more than the guard costs,
so it also times the guard's own work directly: its pre-forward hook (as the model calls it) and its step-boundary
events, per step.

    python benchmarks/guard_overhead.py [--rounds 3] [--steps 30] [--max-length 512] [--batch 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import CAPYBARA, TINY_MODEL  # noqa: E402  (offline environment, sample data)

WARMUP_STEPS = 3


def step_times(argv: list[str], guard: object | None) -> list[float]:
    """Seconds of each optimizer step after the first WARMUP_STEPS, from the trainer's own step events."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTTrainer
    from trl.scripts.sft import make_parser

    torch.manual_seed(0)
    marks: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]  # transformers ships no type hints for it
        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            marks[-1] = time.perf_counter() - marks[-1]

    _, config, *_ = make_parser().parse_args_and_config(argv, return_remaining_strings=True)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype="float32")
    trainer = SFTTrainer(model=model, args=config, processing_class=AutoTokenizer.from_pretrained(TINY_MODEL),
                         train_dataset=load_dataset("json", data_files=str(CAPYBARA), split="train"),
                         callbacks=[Clock(), *([guard] if guard is not None else [])])
    trainer.train()
    return marks[WARMUP_STEPS:]


def timed_guard(plan: object, record: Path) -> tuple[object, list[float]]:
    """A ShapeGuard whose own work is timed: every hook call (through the wrapper the model calls) and every
    step-boundary event, summed into one entry per optimizer step."""
    from shapeplan import ShapeGuard
    from shapeplan.guard.recorder import ShapeRecorder

    spent = [0.0]

    class Timed(ShapeGuard):  # type: ignore[misc,valid-type]  # ShapeGuard is resolved lazily
        def _attach(self) -> None:
            hook = ShapeRecorder._hook

            def timing_hook(recorder: ShapeRecorder, module: object, fn: object) -> None:
                def timed(*args: object, **kwargs: object) -> None:
                    start = time.perf_counter()
                    try:
                        fn(*args, **kwargs)  # type: ignore[operator]  # a forward pre-hook
                    finally:
                        spent[-1] += time.perf_counter() - start
                hook(recorder, module, timed)

            ShapeRecorder._hook = timing_hook  # type: ignore[method-assign]  # restored below
            try:
                super()._attach()
            finally:
                ShapeRecorder._hook = hook  # type: ignore[method-assign]

        def on_step_end(self, *args: object, **kwargs: object) -> None:
            start = time.perf_counter()
            super().on_step_end(*args, **kwargs)
            spent[-1] += time.perf_counter() - start
            spent.append(0.0)

    return Timed(plan, record=record), spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)

    import torch
    from transformers.utils import logging as hf_logging

    from shapeplan.services.analyze import analyze

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="shapeplan-guard-bench-") as tmp:
        trl = ["--per_device_train_batch_size", str(args.batch), "--max_steps", str(args.steps), "--max_length",
               str(args.max_length), "--pad_to_multiple_of", "64", "--bf16", "false"]
        plan = analyze("sft", ["--dataset_name", str(CAPYBARA), "--model_name_or_path", str(TINY_MODEL), *trl])
        run = [*trl, "--output_dir", tmp, "--report_to", "none", "--use_cpu", "true", "--save_strategy", "no",
               "--logging_steps", "1000", "--disable_tqdm", "true"]
        off: list[float] = []
        on: list[float] = []
        own: list[float] = []
        for _ in range(args.rounds):
            off += step_times(run, None)
            guard, spent = timed_guard(plan, Path(tmp) / "run.json")
            on += step_times(run, guard)
            own += spent[WARMUP_STEPS:-1]
            assert guard.unplanned == {} and guard.stale == [], guard.summary  # type: ignore[attr-defined]
    m_off, m_on = median(off), median(on)
    print(f"tiny model, batch {args.batch}, max_length {args.max_length}, {args.rounds} rounds of {args.steps} steps "
          f"(first {WARMUP_STEPS} of each left out)")
    print(f"median step: guard off {m_off * 1000:.1f} ms, guard on {m_on * 1000:.1f} ms, "
          f"overhead {(m_on - m_off) / m_off:+.2%}")
    print(f"mean step:   guard off {sum(off) / len(off) * 1000:.1f} ms, guard on {sum(on) / len(on) * 1000:.1f} ms, "
          f"overhead {(sum(on) / len(on) - sum(off) / len(off)) / (sum(off) / len(off)):+.2%}")
    print(f"the guard's own work: {median(own) * 1000:.3f} ms per step (median; max {max(own) * 1000:.3f} ms), "
          f"{median(own) / m_off:.3%} of the median step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
