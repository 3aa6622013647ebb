"""Data-parallel warm-ups of the generation trainers: `shapeplan warm` under a 2-rank `accelerate launch` (gloo on
CPU), then a real 2-rank run of the same config launched the same way (tests/warm/dp_rank.py, the trainer built as
tests/warm/grpo_harness.py `real_run` builds it), as tests/warm/test_data_parallel.py does for the other trainers.

Device-op coverage: every device-op signature (tests/warm/placement.py) any rank of the real run dispatches is
dispatched by some rank of the warm-up, the collectives included (`c10d.*`, with their tensors' shapes): DDP's
initial `broadcast_` of parameters and buffers and its gradient `allreduce_` buckets, and the `allgather_`s of the
generation round (each rank's rewards, prompt and completion lengths, the metrics), of the eval losses (cut to the
eval set's prompts modulo both ranks' batches) and of the logged loss and the flos count.

Not compared: the ops of the ranks' object gathers (`gather_object` of the prompt and completion texts for the
logs, tests/warm/placement.py `objects`), whose byte tensors are as long as the run's pickled texts; the test
checks the real run has them.

Every config: a static cache, at most 8 new tokens, completions and prompts bucketed by 8, two optimizer steps, a
log at every step, and prompts from the TLDR sample whose buckets differ between the ranks at the first step (each
rank generates for its own prompts: different generate sizes, static cache lengths and (B, P + C) forwards).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TLDR
from tests.warm.grpo_harness import plan_for
from tests.warm.ranks_harness import assert_covered, warm_then_run_plan

pytestmark = pytest.mark.slow

COMMON = ["--per_device_train_batch_size", "2", "--max_completion_length", "8", "--pad_to_multiple_of", "8",
          "--max_steps", "2", "--logging_steps", "1", "--bf16", "false"]
# config -> (method, TLDR rows, TRL options)
CONFIGS: dict[str, tuple[str, slice, list[str]]] = {
    # one prompt's 2 generations per rank and round; an evaluation after step 2 over the 6 prompts, each rank's
    # eval loop generating for 3 batches of its own prompts (`eval_generate`, then the eval forward)
    "grpo-eval": ("grpo", slice(0, 6), [*COMMON, "--num_generations", "2", "--eval_strategy", "steps",
                                        "--eval_steps", "2", "--per_device_eval_batch_size", "2",
                                        "--dataset_test_split", "train"]),
    # a generation batch of 2 prompts x 2 generations per rank trained over 2 micro-steps (old log-probs, which
    # RLOO computes every round, and the reference forward of beta 0.05)
    "rloo-two-steps-per-generation": ("rloo", slice(0, 8), [*COMMON, "--num_generations", "2",
                                                              "--steps_per_generation", "2"]),
    # one generation per prompt, 2 prompts per rank and step, the student and teacher forwards on each
    "distillation": ("distillation", slice(0, 8), COMMON),
}
COLLECTIVES = {"c10d.allreduce_.default", "c10d.allgather_.default", "c10d.broadcast_.default"}


def _warm_then_run(config: str, tmp_path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                          list[dict[str, Any]]]:
    """Plan the 2-rank run, warm it under `accelerate launch`, run it for real the same way: (each rank's warm
    report, each rank's warm-up record, each rank's real-run record)."""
    method, rows, argv = CONFIGS[config]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(TLDR.read_text(encoding="utf-8").splitlines()[rows]) + "\n", encoding="utf-8")
    plan = plan_for(method, data, [*argv, "--num_processes", "2"], tmp_path / "out")
    # the two ranks generate for prompts of different buckets at step 1
    assert len({s.seq for s in plan.by_phase("generate") if s.first_step == 1}) == 2, plan.shapes
    return warm_then_run_plan(plan, method, data, argv, tmp_path, device_ops=True,
                              phases=("generate", "eval_generate"))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_two_rank_warm_up_dispatches_every_device_op_of_the_two_rank_run(config: str, tmp_path: Path) -> None:
    reports, warm, real = _warm_then_run(config, tmp_path)
    assert_covered(reports, warm, real, COLLECTIVES)
    if CONFIGS[config][0] != "distillation":  # GRPO and RLOO gather the texts they log; Distillation logs none
        assert any(s[0] == "c10d.allgather_.default" for s in real[0]["objects"] | real[1]["objects"])
