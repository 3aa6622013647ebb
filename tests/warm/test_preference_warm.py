"""The DPO and Reward warmers' synthetic batches, through the trainers' real collators: each has its task's shape and
completion-token counts; and a DPO plan with a reference precompute pass warms it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shapeplan.adapters.trl_args import parse_training_args
from shapeplan.cli import main
from shapeplan.plan.io import write_plan
from shapeplan.services.trainers import TRAINERS
from shapeplan.warm.dpo import counted_batch
from shapeplan.warm.kto import kto_batch
from shapeplan.warm.model import WarmTask
from tests.conftest import ROOT, TINY_MODEL
from tests.warm.harness import plan_for

EXPLICIT = ROOT / "tests" / "fixtures" / "preference-explicit.jsonl"


def test_counted_batch_holds_the_counts_and_the_longest_row() -> None:
    batch = counted_batch(3, 100, 150, 7)
    assert batch is not None
    assert sum(c for _, c, _ in batch.rows) == 150 and sum(r for _, _, r in batch.rows) == 7
    assert max(max(p + c, p + r) for p, c, r in batch.rows) == 100
    assert all(p >= 1 for p, _, _ in batch.rows)
    assert counted_batch(3, 100, 3 * 99 + 1, 0) is None


def _warmer(method: str, argv: list[str]) -> Any:
    spec = TRAINERS[method]
    return spec.warmer(parse_training_args(spec, ["--model_name_or_path", str(TINY_MODEL), *argv]))


@pytest.mark.parametrize("max_length", [None, 300])
def test_dpo_batches_have_the_task_shape_and_counts(max_length: int | None) -> None:
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    warmer = _warmer("dpo", [] if max_length is None else ["--max_length", str(max_length)])
    task = WarmTask(phase="train", batch=6, seq=384, completion_tokens=(5, 400, 500, 897))
    collator = DataCollatorForPreference(pad_token_id=0, max_length=max_length, pad_to_multiple_of=128)
    layouts = warmer.layouts(task)
    rows, index = warmer.rows(layouts)
    counts = set()
    for members in index:
        batch = collator([rows[i] for i in members])
        assert tuple(batch["input_ids"].shape) == (6, 384)
        chosen, rejected = batch["completion_mask"][..., 1:].chunk(2, dim=0)
        counts |= {int(chosen.sum()), int(rejected.sum())}
    assert set(task.completion_tokens) <= counts


def test_reward_batches_have_the_task_shape() -> None:
    from trl.trainer.reward_trainer import DataCollatorForPreference

    warmer = _warmer("reward", ["--max_length", "300"])
    collator = DataCollatorForPreference(pad_token_id=0, pad_to_multiple_of=128)
    rows, index = warmer.rows(warmer.layouts(WarmTask(phase="eval", batch=4, seq=384)))
    assert all(len(rows[i]["chosen_ids"]) <= 300 and len(rows[i]["rejected_ids"]) <= 300 for m in index for i in m)
    assert [tuple(collator([rows[i] for i in m])["input_ids"].shape) for m in index] == [(4, 384)]


@pytest.mark.parametrize(("kl_seq", "chosen", "counts"), [(384, 1, (0, 700)), (128, 3, (500, 0)), (256, 2, (300, 5))])
def test_kto_batches_have_the_shapes_and_counts(kl_seq: int, chosen: int, counts: tuple[int, int]) -> None:
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    warmer = _warmer("kto", [])
    warmer._kl = {("train", 3, 384): [kl_seq]}
    task = WarmTask(phase="train", batch=3, seq=384, chosen_rows=(chosen,), completion_tokens=counts)
    rows, index = warmer.rows(warmer.layouts(task))
    collator = DataCollatorForUnpairedPreference(pad_token_id=0, pad_to_multiple_of=128)
    met = set()
    for members in index:
        batch = collator([rows[i] for i in members])
        assert (tuple(batch["input_ids"].shape), tuple(batch["KL_input_ids"].shape)) == ((3, 384), (3, kl_seq))
        labels = batch["label"].tolist()
        mask = batch["completion_mask"][:, 1:]
        met.add((sum(labels), int(mask[[i for i, x in enumerate(labels) if x]].sum()),
                 int(mask[[i for i, x in enumerate(labels) if not x]].sum())))
    assert (chosen, *counts) in met
    assert kto_batch(3, 383, 127, 1, (100, 200)) is None  # a carrier row needs 256 completion tokens


@pytest.mark.slow
def test_dpo_precompute_plan_warms_its_precompute_shapes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    write_plan(plan_for("dpo", EXPLICIT, ["--per_device_train_batch_size", "2", "--max_steps", "1",
                                          "--precompute_ref_log_probs", "true"], tmp_path / "out"), plan)
    capsys.readouterr()
    assert main(["warm", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(tmp_path / "c"), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert {r["status"] for r in results} <= {"compiled", "cached", "eager"}
    assert any(r["key"].startswith("ref_precompute ") for r in results)
