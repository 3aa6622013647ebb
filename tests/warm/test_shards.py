"""`warm --shard I/N`: the shard from the option or the scheduler's environment (Slurm, Kubernetes, AWS Batch), and
the split every shard computes alone, from the plan."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path

import pytest

from shapeplan.errors import UsageError
from shapeplan.warm.model import WarmTask
from shapeplan.warm.rounds import GenerateTask
from shapeplan.warm.shards import Shard, parse_shard, resolve_shard, shard_tasks
from tests import console
from tests.conftest import ROOT

SHAPEPLAN = console.SHAPEPLAN


def test_shard_option() -> None:
    assert parse_shard("3/8") == Shard(3, 8, "--shard")
    assert resolve_shard("0/1", None, {"SLURM_ARRAY_TASK_ID": "5"}) == Shard(0, 1, "--shard")  # the option wins


@pytest.mark.parametrize("text", ["3/3", "0/0", "-1/2", "1", "a/b", "1/2/3", ""])
def test_mismatched_or_malformed_shard_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError):
        parse_shard(text)


def test_slurm_array_with_count_and_with_min_max() -> None:
    env = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "0"}
    assert resolve_shard(None, None, env) == Shard(5, 8, "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT")
    # --array=1-8: shard ids count from the array's first index
    env = {"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "8"}
    assert resolve_shard(None, None, env) == Shard(7, 8, "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_MIN/MAX")
    with pytest.raises(UsageError, match="SLURM_ARRAY_TASK_COUNT"):
        resolve_shard(None, None, {"SLURM_ARRAY_TASK_ID": "1"})
    with pytest.raises(UsageError, match=r"0\.\.3"):
        resolve_shard(None, None, {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"})


def test_kubernetes_indexed_job_needs_shard_count() -> None:
    assert resolve_shard(None, 4, {"JOB_COMPLETION_INDEX": "2"}) == Shard(2, 4, "JOB_COMPLETION_INDEX/--shard-count")
    with pytest.raises(UsageError, match="--shard-count"):
        resolve_shard(None, None, {"JOB_COMPLETION_INDEX": "2"})
    with pytest.raises(UsageError, match="JOB_COMPLETION_INDEX"):
        resolve_shard(None, 4, {})


def test_aws_batch_array() -> None:
    env = {"AWS_BATCH_JOB_ARRAY_INDEX": "0", "AWS_BATCH_JOB_ARRAY_SIZE": "3"}
    assert resolve_shard(None, None, env) == Shard(0, 3, "AWS_BATCH_JOB_ARRAY_INDEX/AWS_BATCH_JOB_ARRAY_SIZE")
    with pytest.raises(UsageError, match="AWS_BATCH_JOB_ARRAY_SIZE"):
        resolve_shard(None, None, {"AWS_BATCH_JOB_ARRAY_INDEX": "0"})
    with pytest.raises(UsageError, match="not a non-negative integer"):
        resolve_shard(None, None, {"AWS_BATCH_JOB_ARRAY_INDEX": "x", "AWS_BATCH_JOB_ARRAY_SIZE": "3"})


def test_no_scheduler_no_shard() -> None:
    assert resolve_shard(None, None, {"PATH": "/bin"}) is None


def _tasks() -> list[WarmTask | GenerateTask]:
    # equal costs and sizes (ties only the key can break), and generate sizes of several costs
    return [WarmTask("train", 2, 128), WarmTask("train", 1, 256), WarmTask("eval", 2, 128, per_pass=1),
            WarmTask("train", 4, 128), WarmTask("train", 2, 256), WarmTask("eval", 1, 256, per_pass=2),
            GenerateTask("generate", 2, 64, 71, 8, (8,)), GenerateTask("generate", 2, 128, 135, 8, ())]


def test_shards_are_disjoint_cover_the_plan_and_do_not_depend_on_task_order() -> None:
    tasks = _tasks()
    for count in (1, 2, 3, 5):
        shares = [shard_tasks(tasks, Shard(i, count, "--shard")) for i in range(count)]
        assert sorted(t.key for share in shares for t in share) == sorted(t.key for t in tasks)
        for order in itertools.islice(itertools.permutations(tasks), 0, 200, 7):
            again = [shard_tasks(list(order), Shard(i, count, "--shard")) for i in range(count)]
            assert [{t.key for t in s} for s in again] == [{t.key for t in s} for s in shares]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_COMPLETION", "AWS_BATCH"))}
    return console.run(["warm", "--plan", "plan.json", *args], cwd=Path.cwd(),
                       env={**base, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=120)


@pytest.mark.parametrize(("args", "env"), [
    (["--shard", "3/3"], {}),
    (["--shard", "0/0"], {}),
    (["--shard", "two/4"], {}),
    ([], {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "4"}),
    ([], {"JOB_COMPLETION_INDEX": "1"}),
])
def test_cli_refuses_a_bad_shard_in_one_line_exit_2(args: list[str], env: dict[str, str], tmp_path: Path) -> None:
    done = _cli(*args, "--cache-dir", str(tmp_path / "cache"), env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("Error: ") and done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "cache").exists()


def test_status_merges_the_shard_manifests_and_exits_0_only_when_complete(tmp_path: Path) -> None:
    import torch

    from shapeplan.warm.manifest import Manifest, environment_key, machine_environment, manifest_name
    from shapeplan.warm.model import ManifestEntry
    from tests.conftest import CAPYBARA
    from tests.warm.harness import run_argv

    plan, cache = tmp_path / "plan.json", tmp_path / "cache"
    argv = run_argv(CAPYBARA, ["--max_length", "384", "--per_device_train_batch_size", "1", "--max_steps", "8"],
                    tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    analyzed = console.run(["analyze", *argv, "-o", str(plan)], cwd=Path.cwd(), env=env, timeout=300)
    assert analyzed.returncode == 0, analyzed.stderr

    def status(*json_flag: str) -> subprocess.CompletedProcess[str]:
        return console.run(["warm", "--plan", str(plan), "--status", "--cache-dir", str(cache), "--device", "cpu",
                            *json_flag], cwd=Path.cwd(), env=env, timeout=300)

    def status_json() -> tuple[int, dict]:
        done = status("--json")
        return done.returncode, json.loads(done.stdout)

    code, empty = status_json()
    keys = [s["key"] for s in empty["shapes"]]
    assert code == 1 and empty["missing"] == keys and len(keys) == 3 and not cache.exists()  # nothing created
    environment = {"method": "sft", "versions": {"torch": "x"}, "compiler": {"device": "cpu"}}
    other = {**environment, "versions": {"torch": "y"}}
    cache.mkdir()
    for index, key in enumerate(keys[:2]):  # shards 0 and 1 of 3 done
        Manifest(cache / manifest_name(Shard(index, 3, "--shard"))).record(
            ManifestEntry(environment_key(environment), key, "compiled", 1.0), environment)
    # the last shape done only in another environment, and failed in this one
    Manifest(cache / manifest_name(Shard(2, 3, "--shard"))).record(
        ManifestEntry(environment_key(other), keys[2], "cached", 1.0), other)
    Manifest(cache / manifest_name(None)).record(
        ManifestEntry(environment_key(environment), keys[2], "failed", 1.0), environment)
    code, partial = status_json()
    assert code == 1 and partial["missing"] == [] and not partial["complete"]
    assert [[d["shard"] for d in s["done"]] for s in partial["shapes"]] == [["0/3"], ["1/3"], ["2/3"]]
    Manifest(cache / manifest_name(Shard(2, 3, "--shard"))).record(
        ManifestEntry(environment_key(environment), keys[2], "compiled", 1.0), environment)
    code, complete = status_json()
    assert code == 0 and complete["complete_in"] == [environment_key(environment)]
    text = status()
    assert text.returncode == 0 and "3/3 shape(s) done, complete" in text.stdout
    # complete for the hosts that warmed it (torch "x"), not for a run on this machine: said in one line
    (warning,) = text.stderr.splitlines()
    assert warning.startswith("warning: the plan is complete only in environments other than this machine's: ")
    assert f"torch=x (this machine: {torch.__version__})" in warning
    here = {"method": "sft", **machine_environment("cpu")}
    for key in keys:  # and once warmed in this machine's environment, nothing to say
        Manifest(cache / manifest_name(None)).record(ManifestEntry(environment_key(here), key, "cached", 1.0), here)
    text = status()
    assert text.returncode == 0 and "3/3 shape(s) done, complete" in text.stdout and text.stderr == ""
    no_plan = console.run(["warm", "--status"], env=env, timeout=300)
    assert no_plan.returncode == 2 and no_plan.stderr.count("\n") == 1 and "--plan" in no_plan.stderr
