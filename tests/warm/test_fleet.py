"""A plan warmed by 2 shard processes on CPU (Inductor, `torch_compile`), in both ways of bringing shards together:
a shared cache dir (2 concurrent processes, one killed with -9 and re-run alone) and archives (2 exports,
`cache merge`, `import`). The shards' task sets are disjoint and together the plan; `--status` exits 1 before the
last shard and 0 after; `verify` compiles nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shapeplan.services.run import plan_tasks
from shapeplan.warm.shards import split
from tests import console
from tests.conftest import CAPYBARA, ROOT
from tests.warm.harness import run_argv

pytestmark = pytest.mark.slow

# Two shapes: train at 128 and 256 (batch 1), one a shard; the shared-dir test adds eval at each (four), so that
# the shard it kills after its first shape has one left.
TRAIN = ["--max_length", "256", "--per_device_train_batch_size", "1", "--max_steps", "8", "--torch_compile", "true"]
ARGV = [*TRAIN, "--per_device_eval_batch_size", "1", "--eval_strategy", "steps", "--eval_steps", "8"]
SHARDS = 2


def _env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JOB_COMPLETION", "AWS_BATCH"))}
    return {**base, "PYTHONPATH": str(ROOT), "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES": "0"}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    console.server(_env())  # the module's calls share an environment other than the usual one
    return console.run(args, env=_env(), timeout=3600)


def _shard(plan: Path, cache: Path, index: int, log: Path, *, forked: bool = True) -> subprocess.Popen[str]:
    """A shard's `shapeplan warm` started side by side with the others; `forked`: as a fork of the worker's server
    (tests/forked_python.py), else a fresh process (one the test kills: a fork's client cannot pass on SIGKILL)."""
    python, env = console.forked_python(_env()) if forked else ([sys.executable], _env())
    return subprocess.Popen([*python, console.SHAPEPLAN, "warm", "--plan", str(plan), "--device", "cpu",
                             "--cache-dir", str(cache), "--shard", f"{index}/{SHARDS}", "--json"],
                            stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env)


def _warmed(stdout: str) -> set[str]:
    return {r["key"] for r in json.loads(stdout)["results"] if r["status"] in ("compiled", "cached")}


def _status(plan: Path, cache: Path) -> tuple[int, dict]:
    done = _run("warm", "--plan", str(plan), "--status", "--cache-dir", str(cache), "--device", "cpu", "--json")
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def _verify_compiles_nothing(plan: Path, cache: Path) -> None:
    done = _run("verify", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)["results"]
    assert results and all(r["status"] == "cached" and not r["counters"].get("fxgraph_cache_miss") for r in results)


def _plan(folder: Path, argv: list[str], *extra: str) -> Path:
    path = folder / "plan.json"
    done = _run("analyze", *run_argv(CAPYBARA, argv, folder / "out"), *extra, "-o", str(path))
    assert done.returncode == 0, done.stderr
    return path


def test_shared_cache_dir_with_a_shard_killed_and_rerun(tmp_path: Path) -> None:
    plan = _plan(tmp_path, ARGV, "--eval-dataset", str(CAPYBARA))
    assert len(json.loads(plan.read_text())["shapes"]) == 2 * SHARDS
    # the victim: a shard whose share compiles a train shape first and has a shape left after it
    shares = split(plan_tasks(str(plan), "cpu"), SHARDS)
    v = next(i for i, share in enumerate(shares) if len(share) > 1 and share[0].key.startswith("train"))
    cache = tmp_path / "fsx"
    procs = [_shard(plan, cache, i, tmp_path / f"shard{i}.log", forked=i != v) for i in range(SHARDS)]
    victim = cache / f"shapeplan-manifest.{v}-of-{SHARDS}.json"
    while procs[v].poll() is None and not (victim.is_file() and '"status"' in victim.read_text()):
        time.sleep(0.05)
    procs[v].send_signal(signal.SIGKILL)  # after its first shape
    procs[v].wait()
    outputs = {i: procs[i].communicate()[0] for i in range(SHARDS) if i != v}
    assert all(procs[i].returncode == 0 for i in outputs), [(tmp_path / f"shard{i}.log").read_text()[-2000:]
                                                            for i in outputs]
    code, before = _status(plan, cache)
    planned = {s["key"] for s in before["shapes"]}
    assert code == 1 and before["missing"]
    others = {name: (cache / name).read_bytes() for name in
              (f"shapeplan-manifest.{i}-of-{SHARDS}.json" for i in outputs)}

    rerun = _run("warm", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache), "--shard",
                 f"{v}/{SHARDS}", "--json")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    report = json.loads(rerun.stdout)
    assert report["shard"] == {"index": v, "count": SHARDS, "source": "--shard"}
    statuses = {r["key"]: r["status"] for r in report["results"]}
    assert {k for k, s in statuses.items() if s != "skipped"} == set(before["missing"])  # exactly the rest
    warmed = [set(statuses), *(_warmed(out) for out in outputs.values())]
    assert sum(map(len, warmed)) == len(planned) and set().union(*warmed) == planned  # disjoint, the whole plan
    assert {name: (cache / name).read_bytes() for name in others} == others  # no other shard's entry lost

    code, after = _status(plan, cache)
    assert code == 0 and not after["missing"] and after["complete"]
    assert {d["shard"] for s in after["shapes"] for d in s["done"]} == {f"{i}/{SHARDS}" for i in range(SHARDS)}
    _verify_compiles_nothing(plan, cache)


def test_archives_merged_and_imported(tmp_path: Path) -> None:
    plan = _plan(tmp_path, TRAIN)
    assert len(json.loads(plan.read_text())["shapes"]) == SHARDS
    caches = [tmp_path / f"local{i}" for i in range(SHARDS)]
    procs = [_shard(plan, caches[i], i, tmp_path / f"shard{i}.log") for i in range(SHARDS)]
    outputs = [proc.communicate()[0] for proc in procs]
    assert all(p.returncode == 0 for p in procs), [(tmp_path / f"shard{i}.log").read_text()[-2000:]
                                                   for i in range(SHARDS)]
    shares = [_warmed(out) for out in outputs]
    parts = []
    for i, cache in enumerate(caches):
        part = tmp_path / f"shard-{i}.tar.gz"
        done = _run("cache", "export", "--cache-dir", str(cache), "-o", str(part))
        assert done.returncode == 0, done.stderr
        parts.append(str(part))

    # before the last shard's part arrives
    assert _run("cache", "import", parts[0], "--cache-dir", str(tmp_path / "early")).returncode == 0
    code, before = _status(plan, tmp_path / "early")
    assert code == 1 and set(before["missing"]) == shares[1]

    merged = tmp_path / "all.tar.gz"
    done = _run("cache", "merge", *parts, "-o", str(merged))
    assert done.returncode == 0, done.stderr
    image = tmp_path / "image"
    done = _run("cache", "import", str(merged), "--cache-dir", str(image))
    assert done.returncode == 0, done.stderr
    code, after = _status(plan, image)
    planned = {s["key"] for s in after["shapes"]}
    assert sum(map(len, shares)) == len(planned) and set().union(*shares) == planned
    assert code == 0 and after["complete"]
    _verify_compiles_nothing(plan, image)
