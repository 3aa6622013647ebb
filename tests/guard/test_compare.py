"""`shapeplan analyze ... --compare RUN`: the plan against a run record, shape by shape, through the console script."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from shapeplan.plan.io import write_plan
from shapeplan.plan.model import Shape
from shapeplan.services.analyze import analyze
from tests.cli.test_exit_codes import ok, refused, shapeplan
from tests.conftest import CAPYBARA, TINY_MODEL

ARGV = ["--dataset_name", str(CAPYBARA), "--model_name_or_path", str(TINY_MODEL), "--max_length", "512",
        "--per_device_train_batch_size", "4", "--max_steps", "6", "--pad_to_multiple_of", "64"]


def test_compare_prints_the_plan_against_what_the_run_met(tmp_path: Path) -> None:
    plan = analyze("sft", ARGV)
    assert [(s.phase, s.batch, s.seq, s.count, s.first_step) for s in plan.shapes] == [
        ("train", 4, 448, 1, 5), ("train", 4, 512, 5, 1)]
    # the run met (4, 512) once more than planned, never met (4, 448), and met (4, 320), which the plan lacks
    met = (dataclasses.replace(plan.shapes[1], count=6), Shape("train", 4, 320, count=1, first_step=6))
    record = tmp_path / "run.json"
    write_plan(dataclasses.replace(plan, shapes=met, observed=True), record)
    lines = ok(shapeplan("analyze", *ARGV, "--compare", record)).splitlines()
    assert [line.split() for line in lines[2:]] == [
        ["phase", "batch", "seq", "planned", "first", "step", "met", "first", "step", "status", "notes"],
        ["-----", "-----", "---", "-------", "----------", "---", "----------", "-------------", "-----"],
        ["train", "4", "448", "1", "5", "-", "-", "not", "met"],
        ["train", "4", "512", "5", "1", "6", "1", "count", "differs"],
        ["train", "4", "320", "-", "-", "1", "6", "unplanned"],
        [],
        ["0/3", "shapes", "as", "planned,", "1", "unplanned,", "1", "not", "met"]]


def test_compare_refuses_a_plan_and_json(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    write_plan(analyze("sft", ARGV), plan)
    refused(shapeplan("analyze", *ARGV, "--compare", plan), 1,
            f"{plan} is a plan, not a run record; record a run with `shapeplan guard --record RUN ...` and compare RUN")
    refused(shapeplan("analyze", *ARGV, "--compare", plan, "--json"), 2,
            "--compare prints a table for people; drop --json (the run record is JSON already)")


def test_a_shape_tool_calls_can_add_to_holds_within_its_range() -> None:
    """A certain generate that tool turns can also meet (max_count): as planned anywhere in count..max_count, and
    met before its certain first step too (a turn of an earlier round); past max_count its count differs."""
    from shapeplan.plan.model import Plan, PlanStats
    from shapeplan.services.report import render_comparison

    shape = Shape("generate", 4, 640, count=1, first_step=2, max_count=3, cache_len=703, max_new_tokens=64)
    plan = Plan(method="grpo", exact=True, pad_to_multiple_of=128, shapes=(shape,),
                stats=PlanStats(rows=8, dropped_rows=0, micro_batches=2, optimizer_steps=2, tokens=0,
                                padded_tokens=0))
    for met, status in ((2, "as planned"), (4, "count differs")):
        record = dataclasses.replace(plan, shapes=(dataclasses.replace(shape, count=met, first_step=1,
                                                                       max_count=None),), observed=True)
        row = render_comparison(plan, record).splitlines()[4].split()
        assert row[:8] == ["generate", "4", "640", "1..3", "2", str(met), "1", *status.split()[:1]], row
        assert " ".join(row[7:9]) == status


def test_a_run_that_did_not_pin_the_plans_cache_is_told_how() -> None:
    """A plan that pins the cache (`pin_cache`, the default with tools) against a run that ran without the pin: its
    generate calls at other cache lengths are unplanned, and the comparison says why and how to pin the run."""
    from shapeplan.plan.model import Plan, PlanStats
    from shapeplan.services.report import render_comparison

    shape = Shape("generate", 4, 640, count=1, first_step=1, cache_len=1151, max_new_tokens=512)
    plan = Plan(method="grpo", exact=True, pad_to_multiple_of=128, shapes=(shape,),
                stats=PlanStats(rows=8, dropped_rows=0, micro_batches=2, optimizer_steps=2, tokens=0,
                                padded_tokens=0), config={"pin_cache": 1151, "generation_kwargs": {"top_k": 5}})
    unpinned = dataclasses.replace(plan, shapes=(dataclasses.replace(shape, cache_len=1151 - 128),), observed=True)
    assert render_comparison(plan, unpinned).splitlines()[-1] == (
        "the run generated at cache lengths 1023, and the plan is of a run whose cache is pinned at 1151 (its "
        "pin_cache): run it under `shapeplan guard --plan PLAN`, which pins it, or pass --generation_kwargs "
        "'{\"top_k\": 5, \"max_cache_len\": 1151}'")
    assert "pinned" not in render_comparison(plan, dataclasses.replace(unpinned, shapes=plan.shapes))
