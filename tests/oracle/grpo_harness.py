"""The GRPO/RLOO shape oracle: a real `GRPOTrainer` or `RLOOTrainer` on CPU with the bundled tiny model,
recording every model input it makes, by phase and step, through the guard's recorder (the phase rules live in
`shapeplan.guard.recorder`). Plans are checked against this, never against the notes.
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shapeplan.guard.recorder import Forward
from shapeplan.services.trainers import TRAINERS
from tests.conftest import TINY_MODEL
from tests.oracle.harness import end_rank, load_data, run_ranks


def completion_length_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def run_generation_trainer(method: str, train_path: Path, argv: Sequence[str], *,
                           eval_path: Path | None = None, guard: Any = None,
                           streaming: bool = False, **objects: Any) -> list[Forward]:
    """Train with `trl <method>`'s parser on `argv` (TRL options), recording what the models are fed. `streaming`
    loads the data as `trl <method> --dataset_streaming` does (`harness.load_data`); `objects`: the trainer's
    arguments no command line passes (tools=, environment_factory=)."""
    import torch
    import trl
    from transformers import AutoModelForCausalLM

    from shapeplan import ShapeGuard

    parser = importlib.import_module(TRAINERS[method].script).make_parser()
    output_dir = tempfile.mkdtemp(prefix="shapeplan-oracle-")
    _, config, model_args, *_ = parser.parse_args_and_config([
        "--output_dir", output_dir, "--report_to", "none", "--use_cpu", "true", "--save_strategy", "no",
        "--logging_steps", "1000", "--bf16", "false", "--disable_tqdm", "true", *argv], return_remaining_strings=True)
    train = load_data(train_path, streaming)
    eval_ds = load_data(eval_path, streaming) if eval_path else None
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    seen: list[Forward] = []
    guard = guard or ShapeGuard(on_unplanned="record")  # a test's own guard checks the run against a plan
    guard.on_forward = seen.append
    trainer = TRAINERS[method].trainer()(model=model, reward_funcs=[completion_length_reward], args=config,
                                         train_dataset=train, eval_dataset=eval_ds, callbacks=[guard],
                                         peft_config=trl.get_peft_config(model_args), **objects)
    # The tiny model's decode steps are too small to share between threads: one thread runs them 3x faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    return seen


def run_generation_trainer_distributed(method: str, train_path: Path, argv: Sequence[str], *, tmp_dir: Path,
                                       eval_path: Path | None = None, streaming: bool = False,
                                       num_processes: int = 2) -> list[Forward]:
    """`run_generation_trainer` in `num_processes` CPU processes joined by gloo; every rank's records."""
    spec = {"method": method, "train": str(train_path), "argv": list(argv), "streaming": streaming,
            "eval": str(eval_path) if eval_path else None}
    return run_ranks("tests.oracle.grpo_harness", spec, num_processes=num_processes, tmp_dir=tmp_dir)


Key = tuple[str, int, int, int | None, int | None]


def observed(seen: Sequence[Forward]) -> dict[Key, tuple[int, int]]:
    """(phase, batch, seq, cache_len, logits_to_keep) -> (count, first step)."""
    keys = [(s.phase, s.batch, s.seq, s.cache_len, s.logits_to_keep) for s in seen]
    counts = Counter(keys)
    first: dict[Key, int] = {}
    for key, s in zip(keys, seen, strict=True):
        first[key] = min(first.get(key, s.step), s.step)  # several ranks' records are concatenated, not interleaved
    return {k: (counts[k], first[k]) for k in counts}


def planned(plan: Any, *, certain_only: bool = False) -> dict[Key, tuple[int, int]]:
    return {(s.phase, s.batch, s.seq, s.cache_len, s.logits_to_keep): (s.count, s.first_step)
            for s in plan.shapes if s.certain or not certain_only}


if __name__ == "__main__":  # one rank of run_generation_trainer_distributed
    spec = json.loads(sys.argv[1])
    records = run_generation_trainer(spec["method"], Path(spec["train"]), spec["argv"], streaming=spec["streaming"],
                                     eval_path=Path(spec["eval"]) if spec["eval"] else None)
    Path(spec["out"]).write_text(json.dumps([asdict(s) for s in records]))
    end_rank()
