"""The run record's pieces without a trainer: ranks' shapes merged as a plan merges them, the `observed` flag through
the plan file, and the guard's refusals of bad arguments."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shapeplan import ShapeGuard
from shapeplan.errors import UsageError
from shapeplan.guard.record import gather, merge_shapes
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


def test_ranks_gather_over_gloo_not_the_run_s_device_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a neuron group the guard's own payload would be a collective of a new size: a compile after the run."""
    import torch.distributed as dist

    made, used = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw) or "host group")

    def all_gather_object(parts: list[object], obj: object, group: object = None) -> None:
        used.append(group)
        parts[:] = [obj, obj]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    shape = Shape(phase="train", batch=2, seq=128, count=1, first_step=1)
    for backend, group in (("neuron", "host group"), ("gloo", None)):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, backend=backend: backend)
        merged = gather((shape,), [], {})
        assert merged is not None and merged[0][0].count == 2 and used[-1] == group
    assert made == [{"backend": "gloo"}]


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
