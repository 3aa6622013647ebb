"""Warming in parallel: the split over workers and ranks, NeuronCore groups, the ranks' lockstep, and real runs:
`--workers 2` and a 2-rank `accelerate launch` (gloo on CPU) each warm every shape once, into one manifest."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shapeplan.errors import UsageError
from shapeplan.warm import parallel
from shapeplan.warm.backends import neuron
from shapeplan.warm.manifest import MANIFEST
from shapeplan.warm.model import WarmTask
from shapeplan.warm.parallel import (
    Part,
    core_groups,
    current_part,
    worker_count,
    worker_env,
)
from shapeplan.warm.rounds import Call, GenerateTask, Round, lockstep, task_rounds
from shapeplan.warm.shards import split
from tests import console
from tests.conftest import CAPYBARA, ROOT, TLDR
from tests.warm.grpo_harness import run_argv as grpo_argv
from tests.warm.harness import run_argv as sft_argv
from tests.warm.ranks_harness import json_reports


def _generate(seq: int, completions: tuple[int, ...] = ()) -> GenerateTask:
    return GenerateTask("generate", 2, seq, seq + 7, 8, completions)


def test_split_gives_the_costliest_task_to_the_least_loaded_share_and_keeps_plan_order() -> None:
    a, b, c = _generate(64, (8,)), _generate(128, (8, 16)), _generate(192)  # 13, 14 and 12 minutes
    sft = [WarmTask("train", 2, 512), WarmTask("train", 2, 128), WarmTask("train", 4, 256)]  # 1 minute each
    assert split([a, b, c, *sft], 2) == [[b, *sft], [a, c]]
    assert split([a], 3) == [[a], [], []]


def test_part_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SHAPEPLAN_WORKER", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert current_part() is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert current_part() == Part(3, 4, ranks=True)
    monkeypatch.setenv("SHAPEPLAN_WORKER", "1/2")  # a worker's own part wins
    assert current_part() == Part(1, 2, ranks=False)


def test_neuron_core_groups_are_aligned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    monkeypatch.setattr(neuron, "DEVICE_DIR", Path("/nonexistent"))  # no devices: cores from 0
    assert core_groups(4, 1) == ["0", "1", "2", "3"]
    assert core_groups(2, 2) == ["0-1", "2-3"]
    assert worker_env(1, 2, "neuron", 2) == {"SHAPEPLAN_WORKER": "1/2", "NEURON_RT_VISIBLE_CORES": "2-3"}
    assert worker_env(1, 2, "cpu", 1) == {"SHAPEPLAN_WORKER": "1/2"}
    with pytest.raises(UsageError):
        core_groups(2, 3)


def test_num_cores_is_asked_of_the_runtime_not_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """NEURON_RT_NUM_CORES=n: n free cores the runtime picks (another job may hold 0..n-1); 0 means all."""
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    monkeypatch.setattr(neuron, "DEVICE_DIR", Path("/nonexistent"))
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "4")
    assert worker_count(8, "neuron", 1.0) == 4
    assert worker_env(1, 2, "neuron", 2) == {"SHAPEPLAN_WORKER": "1/2", "NEURON_RT_NUM_CORES": "2"}
    with pytest.raises(UsageError, match=r"NEURON_RT_NUM_CORES=4 asks for too few .*; pass --workers 1"):
        worker_env(0, 2, "neuron", 3)
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "0")
    assert worker_env(1, 2, "neuron", 2) == {"SHAPEPLAN_WORKER": "1/2", "NEURON_RT_VISIBLE_CORES": "2-3"}


def test_a_preset_visible_core_range_is_split_into_aligned_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")
    assert [worker_env(i, 4, "neuron", 1)["NEURON_RT_VISIBLE_CORES"] for i in range(4)] == ["4", "5", "6", "7"]
    assert core_groups(2, 2) == ["4-5", "6-7"]
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0,1,2,3")
    assert core_groups(2, 2) == ["0-1", "2-3"]
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "1-3")  # 1,2 cannot run collectives together
    assert core_groups(1, 2) == ["2-3"]
    with pytest.raises(UsageError, match=r"hold 1 aligned group\(s\) of 2, too few for 2 workers"):
        core_groups(2, 2)


def test_workers_are_capped_by_the_visible_logical_cores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(parallel, "available_memory_gib", lambda: 1024.0)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")
    monkeypatch.setattr(parallel, "usable_cores", lambda: 2)
    assert worker_count(8, "neuron", None) == 4  # a neuron worker waits on its NeuronCore, not a host core
    assert worker_count(8, "cpu", None) == 2  # a cpu worker needs a host core
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    for i in range(2):  # a trn2 host with two Neuron devices: 16 physical cores, 8 logical at the default LNC=2
        (tmp_path / f"neuron{i}").touch()
    monkeypatch.setattr(neuron, "DEVICE_DIR", tmp_path)
    (tmp_path / "product_name").write_text("trn2.48xlarge\n")
    monkeypatch.setattr(neuron, "INSTANCE_TYPE_FILE", tmp_path / "product_name")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert worker_count(64, "neuron", None) == 8
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert worker_count(64, "neuron", None) == 16


def test_lockstep_pads_rounds_and_calls_with_warmed_work() -> None:
    task = _generate(64, (8,))
    own = Call(2, 64)
    first = [Round(task, own, (Call(2, 72), Call(2, 64, 1, 2)), last=False), Round(task, Call(2, 64, 8, 0), last=True)]
    second = [Round(task, own, (Call(2, 64, 3, 2),), last=True)]
    padded = lockstep([first, second])
    assert padded[0] == first
    assert padded[1] == [Round(task, own, (Call(2, 64, 3, 2), Call(2, 64, 1, 2)), last=True),
                         Round(None, Call(2, 64, 1, 2), ())]


def test_lockstep_gives_a_rank_with_no_rounds_repeats_of_another_ranks_last() -> None:
    task = _generate(64, (8,))
    rounds = [Round(task, Call(2, 64), (Call(2, 64, 1, 2),)), Round(task, Call(2, 64, 8, 0), last=True)]
    padded = lockstep([rounds, []])
    assert padded[0] == rounds
    assert padded[1] == [Round(None, Call(2, 64, 8, 2), (Call(2, 64, 1, 2),)), Round(None, Call(2, 64, 8, 2))]


def test_two_ranks_end_every_count_of_gathered_rows_in_eos() -> None:
    """TRL selects the EOS-terminated lengths out of the ranks' gathered completion lengths: the full-length calls of
    two ranks together end 0..2B rows in EOS, each rank 0..B of its own, also where one rank only pads."""
    a, b = _generate(64, (8,)), _generate(128, (8,))
    for shares in ([task_rounds(a, 8, ranks=2), task_rounds(b, 8, ranks=2)], [task_rounds(a, 8, ranks=2), []]):
        padded = lockstep(shares)
        calls = list(zip(padded[0][0].before, padded[1][0].before, strict=True))
        full = [(x, y) for x, y in calls if x.length == 8]  # max_new_tokens
        assert [x.eos_rows_of(0) + y.eos_rows_of(1) for x, y in full] == [0, 1, 2, 3, 4]
        assert {x.eos_rows_of(0) for x, _ in full} == {y.eos_rows_of(1) for _, y in full} == {0, 1, 2}
        assert all(x.eos_rows_of(0) == y.eos_rows_of(1) == 2 for x, y in calls if x.length < 8)  # stopped early


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _shapeplan(*args: str) -> subprocess.CompletedProcess[str]:
    return console.run(args, env=_env(), timeout=900)


def _manifest_shapes(cache: Path) -> dict[str, str]:
    (section,) = json.loads((cache / MANIFEST).read_text())["environments"].values()
    return {key: entry["status"] for key, entry in section["shapes"].items()}


@pytest.mark.slow
def test_workers_warm_each_shape_once(tmp_path: Path) -> None:
    plan, cache = tmp_path / "plan.json", tmp_path / "cache"
    argv = ["--max_length", "512", "--per_device_train_batch_size", "2", "--max_steps", "8"]
    analyzed = _shapeplan("analyze", *sft_argv(CAPYBARA, argv, tmp_path / "out"), "--json", "-o", str(plan))
    assert analyzed.returncode == 0, analyzed.stderr
    planned = sorted(f"train {s['batch']}x{s['seq']}" for s in json.loads(analyzed.stdout)["shapes"])
    assert len(planned) == 3

    warmed = _shapeplan("warm", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache), "--workers", "2",
                        "--json")
    assert warmed.returncode == 0, warmed.stderr[-3000:]
    results = json.loads(warmed.stdout)["results"]
    assert sorted(r["key"] for r in results) == planned
    assert {r["status"] for r in results} == {"eager"}  # eager CPU compiles nothing
    assert _manifest_shapes(cache) == {key: "eager" for key in planned}

    again = _shapeplan("warm", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache), "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert {r["key"]: r["status"] for r in json.loads(again.stdout)["results"]} == {k: "skipped" for k in planned}


@pytest.mark.slow
def test_two_ranks_under_accelerate_launch_split_the_plan(tmp_path: Path) -> None:
    data, plan, cache = tmp_path / "train.jsonl", tmp_path / "plan.json", tmp_path / "cache"
    data.write_text("\n".join(TLDR.read_text(encoding="utf-8").splitlines()[:16]) + "\n", encoding="utf-8")
    argv = ["--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "8",
            "--pad_to_multiple_of", "8", "--max_steps", "2", "--bf16", "false", "--num_processes", "2"]
    run = grpo_argv(data, argv, tmp_path / "out")[2:]  # DATASET is positional after --method
    analyzed = _shapeplan("analyze", "--method", "grpo", str(data), *run, "-o", str(plan))
    assert analyzed.returncode == 0, analyzed.stderr
    generate = json.loads(plan.read_text())["shapes"]
    sizes = sorted((s["batch"], s["seq"]) for s in generate if s["phase"] == "generate")
    assert len(sizes) == 4

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
              str(port), "-m", "shapeplan", "warm", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache),
              "--json"]
    warmed = subprocess.run(launch, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert warmed.returncode == 0, warmed.stderr[-3000:]
    reports = json_reports(warmed.stdout)
    assert len(reports) == 2 and all(r["environment"]["world_size"] == 2 for r in reports)
    shares = [sorted((r["batch"], r["seq"]) for r in report["results"]) for report in reports]
    assert all(shares) and sorted(shares[0] + shares[1]) == sizes  # disjoint, every size once
    assert {r["status"] for report in reports for r in report["results"]} == {"eager"}
    assert set(_manifest_shapes(cache).values()) == {"eager"} and len(_manifest_shapes(cache)) == 4

    verified = _shapeplan("verify", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache), "--json")
    assert verified.returncode == 0, verified.stderr[-3000:]
    assert [r["status"] for r in json.loads(verified.stdout)["results"]] == ["eager"] * 4


def test_workers_refuse_a_data_parallel_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shapeplan.cli import main
    from shapeplan.plan.io import write_plan
    from tests.warm.harness import plan_for

    argv = ["--max_length", "256", "--per_device_train_batch_size", "2", "--max_steps", "2", "--num_processes", "2"]
    write_plan(plan_for("sft", CAPYBARA, argv, tmp_path / "out"), tmp_path / "plan.json")
    capsys.readouterr()
    assert main(["warm", "--plan", str(tmp_path / "plan.json"), "--device", "cpu", "--cache-dir", str(tmp_path / "c"),
                 "--workers", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "Error: a data-parallel plan is warmed under `accelerate launch` with its number of processes, whose ranks "
        "share the shapes; drop --workers"]


@pytest.mark.slow
def test_kill_9_of_warm_with_workers_then_resume(tmp_path: Path) -> None:
    """kill -9 of `shapeplan warm --workers 2` takes its workers down too; the manifest they shared is valid and
    holds only finished shapes; the next run warms exactly the rest."""
    import signal
    import time

    plan, cache = tmp_path / "plan.json", tmp_path / "cache"
    argv = ["--max_length", "512", "--per_device_train_batch_size", "2", "--max_steps", "8"]
    analyzed = _shapeplan("analyze", *sft_argv(CAPYBARA, argv, tmp_path / "out"), "--json", "-o", str(plan))
    assert analyzed.returncode == 0, analyzed.stderr
    planned = {f"train {s['batch']}x{s['seq']}" for s in json.loads(analyzed.stdout)["shapes"]}
    command = [sys.executable, "-m", "shapeplan", "warm", "--plan", str(plan), "--device", "cpu", "--cache-dir",
               str(cache), "--json"]
    proc = subprocess.Popen([*command, "--workers", "2"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not (cache / MANIFEST).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "warm finished before it could be killed"
    time.sleep(2)  # the workers get SIGKILL when their parent dies

    done = _manifest_shapes(cache)  # valid JSON: every record is written atomically, under the lock
    assert 1 <= len(done) < len(planned) and set(done) <= planned and set(done.values()) == {"eager"}
    after = _manifest_shapes(cache)
    assert after == done  # nothing is still writing

    resumed = _shapeplan(*command[3:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    statuses = {r["key"]: r["status"] for r in json.loads(resumed.stdout)["results"]}
    assert statuses == {key: "skipped" if key in done else "eager" for key in planned}


def test_workers_warnings_reach_the_merged_report(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each worker's report warnings (a per-rank cache dir, NFS, verify's key findings) are carried into the merged
    report, each once."""
    shared = "cache dir /fsx/rank_0/neff holds a rank (rank_0): ...; use one dir for every rank"
    said = [[shared, "cache dir /efs/c is on nfs4 (mounted at /efs): ..."],
            [shared, "verify: train (2, 256) compiled again a key the warm-up compiled ('k', 5 ms): ..."]]

    class Worker:
        def __init__(self, command: list[str], **kwargs: object) -> None:
            index = int(kwargs["env"][parallel.WORKER_ENV].partition("/")[0])  # type: ignore[index]
            self.returncode, self.report = 0, {
                "cache_dir": str(tmp_path), "device": "cpu", "environment": {}, "script_lines": [],
                "warnings": said[index],
                "results": [{"phase": "train", "batch": 2, "seq": 128 * (index + 1),
                             "key": f"train 2x{128 * (index + 1)}", "status": "compiled", "seconds": 1.0,
                             "counters": {}}]}

        def communicate(self) -> tuple[str, None]:
            return json.dumps(self.report), None

    monkeypatch.setattr(subprocess, "Popen", Worker)
    report = parallel.run_workers(tmp_path / "plan.json", count=2, device="cpu", cache_dir=tmp_path)
    assert [r.task.key for r in report.results] == ["train 2x128", "train 2x256"]
    assert list(report.warnings) == [shared, said[0][1], said[1][1]]
