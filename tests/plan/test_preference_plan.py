"""The pure preference planners on small hand-worked examples (the oracle tests check them against real trainers)."""

from __future__ import annotations

from shapeplan.plan.batches import RunInfo
from shapeplan.plan.dpo import DPOLayout, plan_dpo
from shapeplan.plan.kto import KTOLayout, UnpairedRows, plan_kto
from shapeplan.plan.model import PlanStats
from shapeplan.plan.preference import PairedRows, stacked_batch
from shapeplan.plan.rows import BatchShape
from shapeplan.plan.schedule import TrainLoop


def table(plan) -> dict[tuple[str, int, int], tuple[int, int]]:  # type: ignore[no-untyped-def]
    return {(s.phase, s.batch, s.seq): (s.count, s.first_step) for s in plan.shapes}


def test_stacked_batch_puts_both_sides_in_one_batch_and_truncates_each() -> None:
    rows = PairedRows(chosen=(100, 300, 50), rejected=(130, 90, 20))
    assert stacked_batch(rows, [0, 1], 128, 256) == BatchShape(batch=4, seq=256, tokens=100 + 256 + 130 + 90)
    assert stacked_batch(rows, [0, 1], 128) == BatchShape(batch=4, seq=384, tokens=620)
    assert stacked_batch(rows, [2], None) == BatchShape(batch=2, seq=50, tokens=70)


def test_kto_runs_policy_and_reference_on_rows_and_kl_rows() -> None:
    rows = UnpairedRows(lengths=(100, 200, 150, 300, 60), kl_lengths=(60, 100, 200, 150, 300),
                        prompt=(10, 20, 30, 40, 50), labels=(True, False, True, False, True))
    plan = plan_kto(
        train_rows=rows, layout=KTOLayout(max_length=None, precompute_ref=False),
        loop=TrainLoop(steps_in_epoch=3, gradient_accumulation_steps=1, num_train_epochs=1, max_steps=-1),
        epoch_batches=lambda epoch: [[[0, 1], [2, 3], [4]]], info=RunInfo("kto", rows=5, pad_to_multiple_of=128))
    steps = {(2, 256): 1, (2, 384): 2, (1, 128): 3}
    kl_steps = {(2, 128): 1, (2, 256): 2, (1, 384): 3}
    assert table(plan) == {
        **{(phase, b, s): (1, step) for phase in ("train", "ref") for (b, s), step in steps.items()},
        **{(phase, b, s): (1, step) for phase in ("kl", "ref_kl") for (b, s), step in kl_steps.items()},
    }
    assert plan.stats == PlanStats(rows=5, dropped_rows=0, micro_batches=3, optimizer_steps=3, tokens=810,
                                   padded_tokens=2 * 256 + 2 * 384 + 128)


def test_dpo_precompute_replaces_the_reference_forwards_with_a_pass_before_training() -> None:
    rows = PairedRows(chosen=(100, 300, 50), rejected=(130, 90, 20), prompt=(10, 20, 5))
    plan = plan_dpo(
        train_rows=rows, layout=DPOLayout(max_length=None, precompute_ref=True),
        loop=TrainLoop(steps_in_epoch=2, gradient_accumulation_steps=2, num_train_epochs=2, max_steps=-1),
        epoch_batches=lambda epoch: [[[2, 0], [1]] if epoch == 0 else [[1, 2], [0]]],
        info=RunInfo("dpo", rows=3, pad_to_multiple_of=128),
        eval_rows=rows, eval_batches=[[[0, 1, 2]]], eval_steps=[1, 2],
        precompute_batches=[[[0], [1], [2]]], eval_precompute_batches=[[[0, 1, 2]]])
    assert table(plan) == {
        # epoch 0: rows 2+0 (longest 130), row 1 (300); epoch 1: rows 1+2 (300), row 0 (130)
        ("train", 4, 256): (1, 1), ("train", 2, 384): (1, 1), ("train", 4, 384): (1, 2), ("train", 2, 256): (1, 2),
        ("eval", 6, 384): (2, 1),
        # rows 0 (130), 1 (300), 2 (50) one at a time, then the eval set in one batch
        ("ref_precompute", 2, 256): (1, 0), ("ref_precompute", 2, 384): (1, 0), ("ref_precompute", 2, 128): (1, 0),
        ("ref_precompute", 6, 384): (1, 0),
    }
