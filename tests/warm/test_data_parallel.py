"""Data-parallel warm-ups: `shapeplan warm` under a 2-rank `accelerate launch` (gloo on CPU), then a real 2-rank run
of the same config launched the same way (tests/warm/dp_rank.py, the trainer built as tests/warm/harness.py
`real_run` builds it). Each config evaluates (`eval_strategy steps`, the eval set's last gathered batch cut to a
remainder) and its ranks meet different shapes in the same step.

(a) Device-op coverage: every device-op signature (tests/warm/placement.py) any rank of the real run dispatches is
    dispatched by some rank of the warm-up. The collectives are dispatcher ops too (`c10d.*`, with their tensors'
    shapes) and the test checks the real run met them: `allreduce_` (DDP's gradient buckets), `allgather_`
    (`gather_for_metrics` of the metrics and eval losses, the logged loss, the flos count), `broadcast_` (DDP's
    initial sync of parameters and buffers) and `barrier` (TRL's main-process-first dataset preparation).
(b) torch.compile: the real run with the warmed cache dir has no FX-graph or AOTAutograd cache miss on any rank:
    every graph it loads is a hit on what the warm-up's ranks compiled (a graph one warm rank compiled can serve
    both real ranks, so the counts need not match).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shapeplan.services.trainers import TRAINERS
from shapeplan.warm.model import WarmTask
from tests.conftest import ROOT
from tests.warm.harness import plan_for, run_argv
from tests.warm.ranks_harness import assert_covered, warm_then_run_plan

TEXT = ROOT / "tests" / "fixtures" / "text.jsonl"
PREFERENCE = ROOT / "tests" / "fixtures" / "preference-explicit.jsonl"
UNPAIRED = ROOT / "tests" / "fixtures" / "kto-unpaired.jsonl"
EVAL = ["--eval_strategy", "steps", "--dataset_test_split", "train"]
DPO = ["--max_length", "384", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", *EVAL]
KTO = [*DPO, "--pad_to_multiple_of", "64"]
# config -> (method, data, rows of it, TRL options); rows of different lengths, so two ranks meet different shapes
# at step 1
CONFIGS: dict[str, tuple[str, Path, int, list[str]]] = {
    # 30 rows, eval batches of 4 on 2 ranks: 4 per rank and pass, the last gathered batch cut to 30 % 8 = 6 rows
    "sft": ("sft", TEXT, 30, ["--max_length", "256", "--pad_to_multiple_of", "64", "--per_device_train_batch_size",
                              "2", "--per_device_eval_batch_size", "4", *EVAL]),
    # BFD packing (padding-free batches, each rank's own cu_seq_lens), two micro-batches per optimizer step: 15 packed
    # rows, the last gathered eval batch cut to 15 % 8 = 7 rows
    "sft-padding-free": ("sft", TEXT, 30, ["--max_length", "256", "--packing", "--packing_strategy", "bfd",
                                           "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2",
                                           "--per_device_eval_batch_size", "4", *EVAL]),
    # split_batches: the ranks share batches of 4 train and 6 eval rows (2 and 3 each); 26 rows, the last gathered
    # eval batch cut to 26 % 6 = 2 rows
    "sft-split": ("sft", TEXT, 26, ["--max_length", "256", "--pad_to_multiple_of", "32",
                                    "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "6",
                                    "--accelerator_config", '{"split_batches": true}', *EVAL]),
    # 14 rows, eval batches of 2: 4 per rank and pass, the last cut to 14 % 4 = 2 rows
    "dpo": ("dpo", PREFERENCE, 14, DPO),
    # the reference log-probs of both sets computed before training, the ranks' pass batches gathered and cut
    "dpo-precompute": ("dpo", PREFERENCE, 14, [*DPO, "--precompute_ref_log_probs", "true"]),
    # split_batches: the ranks share each batch of 4 (train, eval and precompute passes), 2 rows each
    "dpo-precompute-split": ("dpo", PREFERENCE, 14, ["--max_length", "384", "--per_device_train_batch_size", "4",
                                                     "--per_device_eval_batch_size", "4", *EVAL,
                                                     "--precompute_ref_log_probs", "true", "--accelerator_config",
                                                     '{"split_batches": true}']),
    # 14 rows, eval batches of 2: the last cut to 14 % 4 = 2 rows; the KL rows are each rank's own batch rotated
    "kto": ("kto", UNPAIRED, 14, KTO),
    "kto-precompute": ("kto", UNPAIRED, 14, [*KTO, "--precompute_ref_log_probs", "true"]),
    # 11 rows once max_length drops 3: the last gathered eval batch cut to 11 % 4 = 3 rows
    "reward": ("reward", PREFERENCE, 14, DPO),
}
COVERAGE_STEPS = ["--max_steps", "3", "--eval_steps", "2", "--logging_steps", "1"]  # two evaluations, a log every step
COMPILE_STEPS = ["--max_steps", "1", "--eval_steps", "1", "--torch_compile", "true"]  # one compile per rank
COLLECTIVES = {"c10d.allreduce_.default", "c10d.allgather_.default", "c10d.broadcast_.default",
               "c10d.barrier.default"}


def _warm_then_run(config: str, steps: list[str], tmp_path: Path, *, device_ops: bool
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Plan the 2-rank run, warm it under `accelerate launch`, run it for real the same way: (each rank's warm
    report, each rank's warm-up record, each rank's real-run record)."""
    method, source, rows, options = CONFIGS[config]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(source.read_text(encoding="utf-8").splitlines(keepends=True)[:rows]), encoding="utf-8")
    argv = [*options, *steps]
    plan = plan_for(method, data, [*argv, "--num_processes", "2"], tmp_path / "out")
    # the two ranks' first micro-batches (GA 1) have different shapes
    assert len({s.seq for s in plan.by_phase("train") if s.first_step == 1}) == 2
    eval_batch = int(options[options.index("--per_device_eval_batch_size") + 1])
    together = eval_batch if "split_batches" in " ".join(options) else 2 * eval_batch  # accelerate's total batch
    assert plan.by_phase("eval") and plan.stats.eval_rows % together > 0  # the last gathered batch is cut
    return warm_then_run_plan(plan, method, data, argv, tmp_path, device_ops=device_ops,
                              phases=("train", "eval", "ref_precompute"))


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_two_rank_warm_up_dispatches_every_device_op_of_the_two_rank_run(config: str, tmp_path: Path) -> None:
    assert_covered(*_warm_then_run(config, COVERAGE_STEPS, tmp_path, device_ops=True), COLLECTIVES)


@pytest.mark.slow
# DPO's graphs: its 2-rank device ops are (a), its compiled graphs held by test_peft_compiles (LoRA, one rank)
@pytest.mark.parametrize("config", ["sft"])
def test_two_rank_run_compiles_nothing_after_a_two_rank_warm_up(config: str, tmp_path: Path) -> None:
    reports, warm, real = _warm_then_run(config, COMPILE_STEPS, tmp_path, device_ops=False)
    assert {r["status"] for report in reports for r in report["results"] if r["phase"] == "train"} == {"compiled"}
    assert all(w["counters"].get("inductor.fxgraph_cache_miss", 0) > 0 for w in warm)  # each rank compiled
    for rank in range(2):  # every graph of every rank came from the warmed cache
        counters = real[rank]["counters"]
        assert counters.get("inductor.fxgraph_cache_miss", 0) == 0, (rank, counters)
        assert counters.get("aot_autograd.autograd_cache_miss", 0) == 0, (rank, counters)
        assert counters.get("inductor.fxgraph_cache_hit", 0) > 0 and counters.get("aot_autograd.autograd_cache_hit", 0)


def test_every_rank_runs_as_many_optimizer_steps_and_eval_passes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The lockstep of the trainer-loop warm-up: rank 0 warms two train shapes and an eval shape, rank 1 nothing;
    both run the same number of steps and of eval passes as long as a planned pass, rank 1 on repeats."""
    import types

    import accelerate

    from shapeplan.adapters.trl_args import parse_training_args
    from shapeplan.warm.sft import SFTWarmer

    warmer = SFTWarmer(parse_training_args(TRAINERS["sft"], run_argv(TEXT, ["--num_processes", "2"], tmp_path)))
    warmer.eval_pass = 3  # batches a planned eval pass runs on each rank
    train, other, evals = WarmTask("train", 2, 128), WarmTask("train", 2, 256), WarmTask("eval", 4, 192, per_pass=4)
    warmer.shares = [[train, other, evals], []]
    schedules = []
    for rank in (0, 1):
        monkeypatch.setattr(accelerate, "PartialState", lambda rank=rank: types.SimpleNamespace(process_index=rank))
        schedules.append(warmer._rank_schedule(warmer.shares[rank], [train, other, evals]))
    (steps, passes), (idle_steps, idle_passes) = schedules
    # each train shape: its step and the steady-state repeat; the eval shape: 4 batches in passes of 3
    assert [s.task for s in steps] == [train, train, other, other]
    assert [[t for t, _ in p] for p in passes] == [[evals] * 3, [evals, None, None]]
    assert len(idle_steps) == 4 and {s.task for s in idle_steps} == {None}  # repeats of the first train shape
    assert [[t for t, _ in p] for p in idle_passes] == [[None] * 3] * 2  # repeats of rank 0's eval batches
    assert {b for p in idle_passes for _, b in p} == {b for p in passes for _, b in p}
