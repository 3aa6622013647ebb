"""The run record's pieces without a trainer: ranks' shapes merged as a plan merges them, the `observed` flag through
the plan file, and the guard's refusals of bad arguments."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shapeplan import ShapeGuard
from shapeplan.errors import UsageError
from shapeplan.guard.record import exchange, gather, merge_shapes
from shapeplan.guard.recorder import trainer_method
from shapeplan.plan.io import load_plan, plan_from_dict, plan_to_dict, write_plan
from shapeplan.plan.model import Plan, PlanStats, Shape


def test_ranks_merge_as_a_plan_merges_them() -> None:
    rank0 = [Shape("train", 1, 256, count=3, first_step=2, cu_seq_lens=(3,), max_length_q=(90,),
                   varlen_pairs=((3, 90),), unpadded=1),
             Shape("eval", 4, 128, count=2, first_step=4)]
    rank1 = [Shape("train", 1, 256, count=2, first_step=1, cu_seq_lens=(4,), max_length_q=(90,),
                   varlen_pairs=((4, 90),)),
             Shape("train", 1, 128, count=1, first_step=3)]
    assert merge_shapes([*rank0, *rank1]) == (
        Shape("train", 1, 128, count=1, first_step=3),
        Shape("train", 1, 256, count=5, first_step=1, cu_seq_lens=(3, 4), max_length_q=(90,),
              varlen_pairs=((3, 90), (4, 90)), unpadded=1),
        Shape("eval", 4, 128, count=2, first_step=4))


def test_ranks_gather_through_the_store_with_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """No collective: over a neuron group the guard's payload would be a collective of a new size (a compile after
    the run); over gloo, a rank exiting right after it could abort in teardown. Two ranks."""
    import threading

    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **kw: pytest.fail("a collective"))
    monkeypatch.setattr(dist, "new_group", lambda *a, **kw: pytest.fail("a collective"))
    store = dist.HashStore()
    shape = Shape(phase="train", batch=2, seq=128, count=1, first_step=1)
    rank1 = threading.Thread(target=lambda: exchange(store, "run", 1, 2, ((shape, shape), [], {})))
    rank1.start()
    got = exchange(store, "run", 0, 2, ((shape,), [], {("train", 2, 128): [0.5]}))
    rank1.join()
    assert got == [((shape,), [], {("train", 2, 128): [0.5]}), ((shape, shape), [], {})]
    assert store.num_keys() == 0  # read and deleted: a second trainer's exchange starts clean
    assert gather((shape,), [], {}) == ((shape,), [], {})  # not distributed: this process's own


def test_observed_round_trips_and_plans_stay_unmarked(tmp_path: Path) -> None:
    plan = Plan(method="sft", exact=True, pad_to_multiple_of=64, shapes=(Shape("train", 4, 512, 5, 1),),
                stats=PlanStats(rows=20, dropped_rows=0, micro_batches=5, optimizer_steps=5, tokens=0,
                                padded_tokens=10240))
    assert "observed" not in plan_to_dict(plan)
    record = tmp_path / "run.json"
    write_plan(dataclasses.replace(plan, observed=True), record)
    assert json.loads(record.read_text())["observed"] is True
    assert load_plan(record).observed and not plan_from_dict(plan_to_dict(plan)).observed


def test_guard_refuses_bad_arguments() -> None:
    with pytest.raises(UsageError, match=r"on_unplanned='stop'; choose one of warn, error, record"):
        ShapeGuard(on_unplanned="stop")
    guard = ShapeGuard()
    with pytest.raises(UsageError, match=r"ShapeGuard only works as a callback of a transformers/TRL Trainer"):
        guard.on_train_begin(None, None, None)
    with pytest.raises(UsageError, match=r"object is not a TRL trainer shapeplan knows"):
        trainer_method(object())
