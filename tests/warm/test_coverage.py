"""Eager coverage for every trainer-loop method of the registry but SFT: every ATen op signature a real `trl <method>`
run dispatches outside data loading is dispatched by the warm-up of its plan (DPO: policy and reference forwards;
KTO: the KL and main forwards, the loss over desirable and undesirable rows; Reward: the sequence classifier's step;
each with backward, optimizer and eval loop). SFT's own test (test_opsig.py) also checks that the warm-up
dispatches nothing more; the generation trainers dispatch device ops, checked by their *_opsig tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from shapeplan.services.trainers import TRAINERS
from tests.conftest import ROOT
from tests.warm.harness import LORA, plan_for, real_run, record, warm_plan

EXPLICIT = ROOT / "tests" / "fixtures" / "preference-explicit.jsonl"
UNPAIRED = ROOT / "tests" / "fixtures" / "kto-unpaired.jsonl"
EVAL_GA = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "2",
           "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "16",
           "--dataset_test_split", "train"]
# a streamed run (IterableDataset): no sampler, and a streamed eval set whose last batch the eval loop does not cut
STREAM_EVAL_GA = ["--dataset_streaming", *EVAL_GA, "--per_device_eval_batch_size", "14"]
# method -> (data, {config name: TRL options})
CASES: dict[str, tuple[Path, dict[str, list[str]]]] = {
    "dpo": (EXPLICIT, {
        # max_length 256 truncates rows, so some batches arrive without padding
        "truncate": ["--per_device_train_batch_size", "2", "--max_length", "256", "--max_steps", "3"],
        "eval-ga": [*EVAL_GA, "--max_length", "384"],
        "stream-eval-ga": [*STREAM_EVAL_GA, "--max_length", "384"],
        # LoRA: the reference forwards run the policy with its adapters disabled (no reference model), in the
        # train steps and in the eval loop
        "eval-ga-lora": [*EVAL_GA, "--max_length", "384", *LORA],
    }),
    "kto": (UNPAIRED, {
        "truncate": ["--per_device_train_batch_size", "3", "--max_length", "256", "--max_steps", "3"],
        "eval-ga": EVAL_GA,
        "stream-eval-ga": STREAM_EVAL_GA,
    }),
    "reward": (EXPLICIT, {
        # max_length 384 drops the rows with a longer side
        "drop": ["--per_device_train_batch_size", "2", "--max_length", "384", "--max_steps", "3"],
        "eval-ga": EVAL_GA,
        "stream-eval-ga": [*STREAM_EVAL_GA, "--max_length", "384"],
    }),
}
COVERED_ELSEWHERE = {"sft"}  # test_opsig.py


def test_every_trainer_loop_method_has_a_coverage_case() -> None:
    from shapeplan.warm.trainer_loop import TrainerLoopWarmer

    loop_methods = {name for name, spec in TRAINERS.items()
                    if isinstance(spec.warmer_class(), type) and issubclass(spec.warmer_class(), TrainerLoopWarmer)}
    assert loop_methods == set(CASES) | COVERED_ELSEWHERE


@pytest.mark.slow
@pytest.mark.parametrize(("method", "name"), [(m, n) for m in TRAINERS if m in CASES for n in sorted(CASES[m][1])])
def test_warm_dispatches_every_op_signature_of_the_real_run(method: str, name: str, tmp_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    data, configs = CASES[method]
    argv = configs[name]
    plan = plan_for(method, data, argv, tmp_path / "out")
    real, _ = record(real_run, method, data, argv, tmp_path / "out")
    warmed, report = record(warm_plan, plan, tmp_path / "cache")
    assert not report.failed, report.failed
    missing = real - warmed
    assert missing == set(), sorted(map(str, missing))[:20]
