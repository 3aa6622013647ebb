"""The warm runner's own logic (manifest, resume, failures, rank shares, the report) on shapeplan.testing's fakes:
no trainer, no compiler, milliseconds per test. (Lockstep's padding of the rounds: test_parallel.py.)"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from shapeplan.errors import UsageError
from shapeplan.plan.model import Plan, PlanStats, Shape
from shapeplan.services.report import result_row
from shapeplan.services.trainers import METHODS
from shapeplan.testing import FakeBackend, FakeWarmer
from shapeplan.warm.manifest import MANIFEST
from shapeplan.warm.model import WarmResult, WarmTask
from shapeplan.warm.runner import warm
from shapeplan.warm.tracker import Tracker


def _plan(*seqs: int, method: str = "sft", processes: int = 1) -> Plan:
    shapes = tuple(Shape(phase="train", batch=2, seq=s, count=1, first_step=1) for s in seqs)
    return Plan(method=method, exact=True, pad_to_multiple_of=128, shapes=shapes,
                stats=PlanStats(rows=4, dropped_rows=0, micro_batches=len(seqs), optimizer_steps=len(seqs),
                                tokens=1, padded_tokens=1), config={"num_processes": processes})


def _backend(cache_dir: Path) -> FakeBackend:
    backend = FakeBackend()
    backend.prepare(cache_dir)
    return backend


def _statuses(results: Sequence[WarmResult]) -> list[tuple[str, str]]:
    return [(r.task.key, r.status) for r in results]


def test_resume_runs_only_what_the_manifest_does_not_hold(tmp_path: Path) -> None:
    first = _backend(tmp_path)
    warm(_plan(128, 256), FakeWarmer(first.meet), first, tmp_path)
    assert first.met == ["train 2x128", "train 2x256"]

    fresh = _backend(tmp_path)  # the next process
    warmer = FakeWarmer(fresh.meet)
    report = warm(_plan(128, 256, 384), warmer, fresh, tmp_path)
    assert _statuses(report.results) == [("train 2x128", "skipped"), ("train 2x256", "skipped"),
                                         ("train 2x384", "compiled")]
    assert warmer.runs == [["train 2x384"]] and fresh.met == ["train 2x384"]


def test_another_environment_does_not_resume_from_this_one(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    warm(_plan(128), FakeWarmer(backend.meet), backend, tmp_path)
    other = FakeWarmer(backend.meet, environment={"method": "sft", "model": "another"})
    report = warm(_plan(128), other, backend, tmp_path)
    # run again, not skipped (the fake keys its cache by task alone, so the run finds it warm)
    assert _statuses(report.results) == [("train 2x128", "cached")] and other.runs == [["train 2x128"]]
    sections = json.loads((tmp_path / MANIFEST).read_text())["environments"]
    assert len(sections) == 2


def test_a_failed_shape_is_recorded_the_others_go_on_and_a_rerun_retries_it(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    report = warm(_plan(128, 256, 384), FakeWarmer(backend.meet, fail={"train 2x256"}), backend, tmp_path)
    assert _statuses(report.results) == [("train 2x128", "compiled"), ("train 2x256", "failed"),
                                         ("train 2x384", "compiled")]
    assert [r.error for r in report.failed] == ["RuntimeError: boom"]
    (section,) = json.loads((tmp_path / MANIFEST).read_text())["environments"].values()
    assert {k: v["status"] for k, v in section["shapes"].items()} == {
        "train 2x128": "compiled", "train 2x256": "failed", "train 2x384": "compiled"}

    retry = FakeWarmer(backend.meet)
    again = warm(_plan(128, 256, 384), retry, backend, tmp_path)
    assert retry.runs == [["train 2x256"]]
    assert [r.status for r in again.results] == ["skipped", "compiled", "skipped"]


def test_a_warmer_that_returns_early_leaves_its_tasks_failed(tmp_path: Path) -> None:
    backend = _backend(tmp_path)

    class Quits(FakeWarmer):
        def run(self, tasks: Sequence[WarmTask], context: Sequence[WarmTask], tracker: Tracker) -> None:
            tracker.start()

    report = warm(_plan(128, 256), Quits(backend.meet), backend, tmp_path)
    assert [(r.status, r.error) for r in report.results] == [("failed", "not run"), ("failed", "not run")]


def test_verify_reruns_everything_and_writes_no_manifest(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    warm(_plan(128, 256), FakeWarmer(backend.meet), backend, tmp_path)
    manifest = (tmp_path / MANIFEST).read_text()
    backend.restart()  # verify runs in a fresh process
    verified = warm(_plan(128, 256, 384), FakeWarmer(backend.meet), backend, tmp_path, verify=True)
    assert [r.status for r in verified.results] == ["cached", "cached", "compiled"]
    assert [r.counters for r in verified.results] == [{"persistent_hits": 1}, {"persistent_hits": 1},
                                                      {"compiles": 1}]
    assert (tmp_path / MANIFEST).read_text() == manifest


def test_the_report_summarizes_in_plan_order(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    warm(_plan(256), FakeWarmer(backend.meet), backend, tmp_path)
    report = warm(_plan(128, 256, 384), FakeWarmer(backend.meet, fail={"train 2x384"}), backend, tmp_path,
                  )
    data = report.to_dict()
    assert [(r["seq"], r["status"]) for r in data["results"]] == [(128, "compiled"), (256, "skipped"),
                                                                   (384, "failed")]
    assert data["summary"]["compiled"] == 1 and data["summary"]["skipped"] == 1 and data["summary"]["failed"] == 1
    assert data["environment"]["compiler"] == {"backend": "fake"}
    assert data["script_lines"] == [f"export FAKE_CACHE_DIR={tmp_path}"]
    assert backend.configured == {"torch_compile": False, "graphs": 6}  # 2 layouts a task, the skipped one too
    row = result_row(report.results[0])
    assert row.split()[:2] == ["compiled", "train"] and row.endswith("compiles=+1")
    assert result_row(report.results[2]).endswith("RuntimeError: boom")


def test_ranks_share_the_tasks_and_a_rank_with_none_still_steps(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    backend = _backend(tmp_path)
    warmer = FakeWarmer(backend.meet)
    for method in METHODS:  # every trainer warms in lockstep
        warmer = FakeWarmer(backend.meet)
        report = warm(_plan(128, method=method, processes=2), warmer, backend, tmp_path)
        assert warmer.shares is not None and [[t.key for t in s] for s in warmer.shares] == [["train 2x128"], []]
        assert warmer.runs == [[]]  # rank 1 has nothing of its own, but runs so that rank 0's collectives complete
        assert report.results == () and report.warnings == ()


def test_ranks_refuse_a_plan_of_another_world_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    backend = _backend(tmp_path)
    for processes in (1, 4):
        with pytest.raises(UsageError, match=rf"^the plan is for {processes} process\(es\) and `accelerate launch` "
                                             rf"started 2; launch with --num_processes {processes}, the run's world "
                                             "size$"):
            warm(_plan(128, processes=processes), FakeWarmer(backend.meet), backend, tmp_path)


def test_one_process_warns_that_a_data_parallel_plans_collectives_are_not_warmed(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    for name in ("SHAPEPLAN_WORKER", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    backend = _backend(tmp_path)
    report = warm(_plan(128, processes=2), FakeWarmer(backend.meet), backend, tmp_path)
    assert [r.status for r in report.results] == ["compiled"]
    assert report.warnings == ("the run has 2 processes and the warm-up one: every rank's shapes are warmed, the "
                               "collectives between ranks are not (warm under `accelerate launch --num_processes 2` "
                               "for them)",)


def test_shapes_run_inside_other_tasks_steps_are_reported_under_their_phase() -> None:
    """GRPO's train forwards run inside each generate size's rounds: no task of their own, still in the report."""
    from dataclasses import replace

    from shapeplan.services.report import render_warm
    from shapeplan.warm.model import WarmReport
    from shapeplan.warm.runner import covered_shapes

    plan = _plan(256, 384)
    plan = replace(plan, shapes=(Shape(phase="generate", batch=8, seq=128, count=2, first_step=1), *plan.shapes,
                                 plan.shapes[0]))
    tasks = (WarmTask(phase="generate", batch=8, seq=128),)
    assert covered_shapes(plan, tasks) == (("train", 2, 256), ("train", 2, 384))  # each distinct shape once
    assert covered_shapes(_plan(256), (WarmTask(phase="train", batch=2, seq=256),)) == ()
    report = WarmReport(results=(WarmResult(task=tasks[0], status="eager", seconds=1.0),), cache_dir="/c",
                        device="cpu", environment={}, covered=covered_shapes(plan, tasks))
    text = render_warm(report, verify=False).splitlines()
    assert text[1:3] == ["also warmed, inside the steps of the shapes above:", "  train         (2, 256) (2, 384)"]
    assert report.to_dict()["covered"] == [{"phase": "train", "batch": 2, "seq": 256},
                                           {"phase": "train", "batch": 2, "seq": 384}]
