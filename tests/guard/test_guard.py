"""ShapeGuard inside real TRL runs on CPU: a run guarded with its own exact plan meets every planned shape as often
as planned and nothing else; a plan with a shape removed is caught before that shape's forward (warn, error) or
recorded (record)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shapeplan import ShapeGuard
from shapeplan.errors import UnplannedShapeError
from shapeplan.plan.io import load_plan
from shapeplan.plan.model import Plan
from shapeplan.services.analyze import analyze
from tests.conftest import CAPYBARA, TINY_MODEL
from tests.oracle.grpo_harness import run_generation_trainer
from tests.oracle.harness import run_sft
from tests.oracle.test_grpo_oracle import _rows

pytestmark = pytest.mark.slow

# what the oracle harnesses pass besides the test's options, as far as it is recorded in a plan
RUN_DEFAULTS = ["--bf16", "false"]
SFT = ["--per_device_train_batch_size", "4", "--max_steps", "6", "--eval_strategy", "steps", "--eval_steps", "4",
       "--per_device_eval_batch_size", "7", "--max_length", "512"]
# a multiple of 64 gives the run a second train shape, first met at step 5
SFT_64 = [*SFT, "--pad_to_multiple_of", "64"]
GRPO = ["--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "32",
        "--max_steps", "4", "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "4",
        "--num_generations_eval", "2", "--beta", "0.05", "--num_iterations", "2", "--cache_implementation", "static"]


def _plan(method: str, data: Path, argv: list[str], eval_data: Path | None = None) -> Plan:
    return analyze(method, ["--dataset_name", str(data), "--model_name_or_path", str(TINY_MODEL), *RUN_DEFAULTS,
                            *argv], eval_source=str(eval_data) if eval_data else None)


def _met(plan: Plan) -> dict[tuple[Any, ...], tuple[int, int]]:
    return {(s.phase, s.batch, s.seq, s.cache_len, s.logits_to_keep): (s.count, s.first_step) for s in plan.shapes}


def _assert_as_planned(guard: ShapeGuard) -> None:
    assert guard.drift == []
    assert guard.unplanned == {}
    assert guard.stale == []
    assert guard.compiles == []  # eager CPU compiles nothing
    planned = len(guard.plan.shapes)  # type: ignore[union-attr]  # the guard was given a plan
    assert guard.summary == f"{planned}/{planned} planned shapes met, 0 unplanned, 0 compiles, counts as planned"


def test_sft_run_meets_its_exact_plan(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    plan = _plan("sft", CAPYBARA, SFT, CAPYBARA)
    guard = ShapeGuard(plan, record=tmp_path / "run.json")
    run_sft(CAPYBARA, ["--pad_to_multiple_of", "128", *SFT], eval_path=CAPYBARA, guard=guard)
    _assert_as_planned(guard)
    assert f"shapeplan: {guard.summary}" in capfd.readouterr().err.splitlines()
    record = load_plan(tmp_path / "run.json")
    assert record.observed and _met(record) == _met(plan)
    assert (record.stats.micro_batches, record.stats.optimizer_steps) == (plan.stats.micro_batches, 6)


def test_grpo_run_meets_its_exact_plan(tmp_path: Path) -> None:
    train, eval_data = _rows(tmp_path / "train.jsonl", 16), _rows(tmp_path / "eval.jsonl", 5)
    plan = _plan("grpo", train, GRPO, eval_data)
    assert {"generate", "eval_generate", "old_logprob", "ref", "train", "eval"} <= {s.phase for s in plan.shapes}
    guard = ShapeGuard(plan, record=tmp_path / "run.json")
    run_generation_trainer("grpo", train, ["--pad_to_multiple_of", "128", *GRPO], eval_path=eval_data, guard=guard)
    _assert_as_planned(guard)
    record = load_plan(tmp_path / "run.json")
    assert _met(record) == _met(plan)
    # generate entries keep their max_new_tokens, so the record warms like the plan
    assert {s.key for s in record.shapes} == {s.key for s in plan.shapes}


def _without_one_train_shape(plan: Plan) -> tuple[Plan, Any]:
    """The plan less the train shape first met latest (after step 1, so the run is under way when it comes)."""
    removed = max((s for s in plan.shapes if s.phase == "train"), key=lambda s: s.first_step)
    assert removed.first_step > 1
    return dataclasses.replace(plan, shapes=tuple(s for s in plan.shapes if s is not removed)), removed


class _WatchingGuard(ShapeGuard):
    """Also records every forward the model *completed* (a post-forward hook, after the guard's pre-hook)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.completed: list[tuple[int, int]] = []

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        super().on_init_end(args, state, control, **kwargs)
        kwargs["model"].register_forward_hook(
            lambda module, inputs, kw, out: self.completed.append(tuple(kw["input_ids"].shape)), with_kwargs=True)


def test_removed_shape_warns_with_its_first_step(capfd: pytest.CaptureFixture[str]) -> None:
    plan, removed = _without_one_train_shape(_plan("sft", CAPYBARA, SFT_64, CAPYBARA))
    guard = ShapeGuard(plan)
    run_sft(CAPYBARA, SFT_64, eval_path=CAPYBARA, guard=guard)
    err = capfd.readouterr().err.splitlines()
    warned = [line for line in err if "unplanned shape" in line]
    assert len(warned) == 1
    assert warned[0].startswith(f"shapeplan: unplanned shape train ({removed.batch}, {removed.seq}) at step "
                                f"{removed.first_step} (rank 0): not in the plan")
    assert list(guard.unplanned) == [("train", removed.batch, removed.seq, None, None, (), None)]
    assert guard.summary.startswith(f"{len(plan.shapes)}/{len(plan.shapes)} planned shapes met, 1 unplanned")
    # ... and the Trainer's logs (what TensorBoard and W&B receive) have it at that step
    history = guard.trainer.state.log_history
    logged = [(e["step"], e["shapeplan/unplanned"]) for e in history if "shapeplan/unplanned" in e]
    assert logged == [(removed.first_step, 1.0)]


def test_removed_shape_errors_before_its_forward() -> None:
    plan, removed = _without_one_train_shape(_plan("sft", CAPYBARA, SFT_64, CAPYBARA))
    guard = _WatchingGuard(plan, on_unplanned="error")
    with pytest.raises(UnplannedShapeError, match=rf"train \({removed.batch}, {removed.seq}\) at step "
                                                  rf"{removed.first_step} "):
        run_sft(CAPYBARA, SFT_64, eval_path=CAPYBARA, guard=guard)
    assert guard.completed, "the run was under way"
    assert (removed.batch, removed.seq) not in guard.completed


def test_removed_shape_is_recorded(tmp_path: Path) -> None:
    full = _plan("sft", CAPYBARA, SFT_64, CAPYBARA)
    plan, removed = _without_one_train_shape(full)
    guard = ShapeGuard(plan, on_unplanned="record", record=tmp_path / "run.json")
    run_sft(CAPYBARA, SFT_64, eval_path=CAPYBARA, guard=guard)
    assert list(guard.unplanned) == [("train", removed.batch, removed.seq, None, None, (), None)]
    assert _met(load_plan(tmp_path / "run.json")) == _met(full)



def _other_trainer(name: str, tmp_path: Path) -> tuple[Plan, Callable[[ShapeGuard], object]]:
    """The plan of one of the oracle's RLOO, DPO, KTO, Reward or Distillation configurations, and its guarded run."""
    from tests.oracle import (
        test_distillation_oracle,
        test_grpo_oracle,
        test_preference_oracle,
    )
    from tests.oracle.distillation_harness import run_distillation_trainer
    from tests.oracle.preference_harness import run_preference

    if name in test_preference_oracle.CONFIGS:
        method, data, argv, eval_data = test_preference_oracle.CONFIGS[name]
        argv = ["--gradient_checkpointing", "false", *argv]  # as the preference harness runs
        return _plan(method, data, argv, eval_data), lambda guard: run_preference(
            method, data, ["--pad_to_multiple_of", "128", *argv], eval_path=eval_data, guard=guard)
    if name in test_distillation_oracle.CONFIGS:
        train_rows, eval_rows, argv = test_distillation_oracle.CONFIGS[name]
        train = _rows(tmp_path / "train.jsonl", train_rows)
        eval_path = _rows(tmp_path / "eval.jsonl", eval_rows) if eval_rows else None
        plan = _plan("distillation", train, ["--teacher_model_name_or_path", str(TINY_MODEL), *argv], eval_path)
        return plan, lambda guard: run_distillation_trainer(
            train, ["--pad_to_multiple_of", "128", *argv], eval_path=eval_path, guard=guard)
    method, train_rows, eval_rows, argv = test_grpo_oracle.CONFIGS[name]
    train = _rows(tmp_path / "train.jsonl", train_rows)
    eval_path = _rows(tmp_path / "eval.jsonl", eval_rows) if eval_rows else None
    return _plan(method, train, argv, eval_path), lambda guard: run_generation_trainer(
        method, train, ["--pad_to_multiple_of", "128", *argv], eval_path=eval_path, guard=guard)


@pytest.mark.parametrize("name", ["rloo-static", "dpo-conversational-precompute-ga", "kto-paired-precompute-ga",
                                  "reward-conversational-drop-eval", "epochs-eval"])
def test_every_trainer_meets_its_exact_plan(name: str, tmp_path: Path) -> None:
    plan, run = _other_trainer(name, tmp_path)
    guard = ShapeGuard(plan, record=tmp_path / "run.json")
    run(guard)
    _assert_as_planned(guard)
    record = load_plan(tmp_path / "run.json")
    assert _met(record) == _met(plan)
    # DPO/KTO: the mask-selected sizes the warm-up reproduces, so `shapeplan warm --plan run.json` warms them too
    assert {s.key: (s.completion_tokens, s.chosen_rows) for s in record.shapes} == \
        {s.key: (s.completion_tokens, s.chosen_rows) for s in plan.shapes}


@pytest.mark.parametrize("name", ["dpo-conversational-precompute-ga", "kto-paired-precompute-ga"])
def test_a_rerun_whose_precompute_pass_trl_reads_from_its_cache(name: str, tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    """TRL keys a precompute pass's result by the dataset's and the model's fingerprints and skips the pass when its
    datasets cache holds it: the second of two identical runs meets no ref_precompute shape, and the guard says why
    instead of calling the plan stale."""
    from tests.oracle import test_preference_oracle
    from tests.oracle.preference_harness import run_preference

    method, data, argv, eval_data = test_preference_oracle.CONFIGS[name]
    argv = ["--gradient_checkpointing", "false", *argv]
    plan = _plan(method, data, argv, eval_data)
    precompute = {k for k in _met(plan) if k[0] == "ref_precompute"}
    assert precompute
    guards = [ShapeGuard(plan), ShapeGuard(plan)]
    for guard in guards:
        run_preference(method, data, ["--pad_to_multiple_of", "128", *argv], eval_path=eval_data, guard=guard,
                       datasets_cache=tmp_path / "datasets")
    first, second = guards
    _assert_as_planned(first)
    assert first.recorder is not None and first.recorder.precomputed_from_cache == []

    assert second.recorder is not None and second.recorder.precomputed_from_cache == ["train", "eval"]
    assert not precompute & set(_met(dataclasses.replace(plan, shapes=second.counter.shapes())))
    assert second.unplanned == {} and second.stale == [] and second.drift == []
    others = len(plan.shapes) - len(precompute)
    assert second.summary == f"{others}/{others} planned shapes met, 0 unplanned, 0 compiles, counts as planned"
    assert ("shapeplan: TRL read the reference log-probs of the train and eval dataset from its datasets cache: that "
            "precompute pass did not run (its planned ref_precompute shapes are not expected)") in \
        capfd.readouterr().err.splitlines()


def test_padding_free_pairs_are_checked_before_the_forward(tmp_path: Path,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    """Padding-free batches compile one graph per (len(cu_seq_lens), max_length_q) pair: a run guarded with its
    exact plan meets only planned pairs; a pair taken out of the plan is named before its forward."""
    from tests.oracle import test_sft_oracle

    data, argv, eval_data = test_sft_oracle.CONFIGS["packing-bfd-eval"]
    plan = _plan("sft", data, argv, eval_data)
    exact = ShapeGuard(plan)
    run_sft(data, argv, eval_path=eval_data, guard=exact)
    _assert_as_planned(exact)

    shape = next(s for s in plan.shapes if len(s.varlen_pairs) > 1)
    pair = shape.varlen_pairs[-1]
    less = dataclasses.replace(shape, varlen_pairs=shape.varlen_pairs[:-1])
    plan = dataclasses.replace(plan, shapes=tuple(less if s is shape else s for s in plan.shapes))
    capfd.readouterr()
    warned = ShapeGuard(plan)
    run_sft(data, argv, eval_path=eval_data, guard=warned)
    key = (shape.phase, shape.batch, shape.seq, None, None, (), None)
    assert list(warned.unplanned) == [(*key, pair)]
    lines = [line for line in capfd.readouterr().err.splitlines() if "unplanned shape" in line]
    assert len(lines) == 1 and f"{shape.phase} {(shape.batch, shape.seq)} with cu_seq_lens of {pair[0]} and " \
        f"max_length_q {pair[1]} at step " in lines[0]
    assert ", 1 unplanned, " in warned.summary

    with pytest.raises(UnplannedShapeError, match=f"with cu_seq_lens of {pair[0]} and max_length_q {pair[1]}"):
        run_sft(data, argv, eval_path=eval_data, guard=ShapeGuard(plan, on_unplanned="error"))


def test_no_compile_makes_any_compile_during_training_an_error() -> None:
    """The run after a bake (vLLM-Neuron's VLLM_NEURON_DISABLE_WARMUP_COMPILE): a counted compile stops it."""
    import time
    from types import SimpleNamespace

    class Counting:
        device = "cpu"
        compiles = 0

        def counters(self) -> dict[str, int]:
            return {"total_compilations": self.compiles}

        def compiled(self, delta: dict[str, int]) -> bool:
            return delta.get("total_compilations", 0) > 0

    for no_compile in (False, True):
        backend = Counting()
        guard = ShapeGuard(backend=backend, no_compile=no_compile)
        guard._counters, guard._clock = backend.counters(), time.perf_counter()
        guard._boundary(SimpleNamespace(global_step=1))  # nothing compiled: fine either way
        backend.compiles = 1
        if not no_compile:
            guard._boundary(SimpleNamespace(global_step=2))
            assert [e.step for e in guard.compiles] == [2]
            continue
        with pytest.raises(UnplannedShapeError, match=r"^a compile during training at step 2 \(no new shape; "
                                                      r"counters moved: total_compilations=\+1\), and the guard"):
            guard._boundary(SimpleNamespace(global_step=2))
