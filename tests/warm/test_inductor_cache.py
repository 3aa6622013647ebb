"""torch.compile: after `shapeplan warm` into a fresh cache dir, the real run in a new process compiles nothing
(zero FX-graph and AOTAutograd cache misses); a second warm and `shapeplan verify` compile nothing either."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import console
from tests.conftest import CAPYBARA, ROOT, SFT_128_ARGV, WarmedSFT

pytestmark = pytest.mark.slow


def shapeplan(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return console.run(args, env=env)


def real_run_in_new_process(cache: Path, script_lines: list[str], out: Path, env: dict[str, str]) -> dict:
    spec = {"data": str(CAPYBARA), "argv": SFT_128_ARGV, "output_dir": str(out), "script_lines": script_lines}
    python, env = console.forked_python({**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
    proc = subprocess.run([*python, "-m", "tests.warm.real_sft", json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Dumps each process's compile-cache counters at exit, so a run through `trl`'s own console script (which starts
# its trainer in a child process under `accelerate launch`) can be counted without changing it.
SITECUSTOMIZE = """
import atexit, json, os, sys
def _dump():
    if "torch._dynamo.utils" in sys.modules:
        from torch._dynamo.utils import counters
        with open(os.environ["SHAPEPLAN_TEST_COUNTERS"], "a") as f:
            groups = ("inductor", "aot_autograd")
            f.write(json.dumps({f"{g}.{k}": int(v) for g in groups for k, v in counters[g].items()}) + "\\n")
atexit.register(_dump)
"""


def test_the_printed_trl_command_with_the_env_file_alone_hits_the_cache(warmed_sft: WarmedSFT,
                                                                        tmp_path: Path) -> None:
    """`. ENV_FILE && trl sft ...` exactly as `warm` prints it (the data file as a dataset folder, the planned
    pad_to_multiple_of spelt out), with TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES from the file: 0 Inductor and
    AOTAutograd misses. Only what this machine lacks is added: --use_cpu, and where the run writes. The shell has
    another thread count than the warm-up had (Inductor's CPU kernels are keyed by it, and `accelerate launch` keeps
    a set OMP_NUM_THREADS): the file's OMP_NUM_THREADS is what makes the run hit."""
    report, env, env_file = warmed_sft.report, warmed_sft.env, warmed_sft.env_file
    assert "export TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0\n" in env_file.read_text()
    threads = f"export OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', '1')}\n"
    assert threads in env_file.read_text()
    other = "2" if threads.endswith("=1\n") else "1"
    command = report["command"]
    assert command[:2] == ["trl", "sft"] and str(CAPYBARA) not in command
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    counters_file = tmp_path / "counters.jsonl"
    clean = {k: v for k, v in env.items() if not k.startswith(("TORCHINDUCTOR_", "TORCH_DYNAMO_"))}
    run = subprocess.run(["bash", "-c", '. "$0" && exec "$@"', str(env_file), *command, "--use_cpu", "true",
                          "--output_dir", str(tmp_path / "trl-run"), "--report_to", "none", "--save_strategy", "no"],
                         cwd=ROOT, env={**clean, "PYTHONPATH": f"{site}:{ROOT}", "OMP_NUM_THREADS": other,
                                        "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
                                        "SHAPEPLAN_TEST_COUNTERS": str(counters_file)},
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    totals: dict[str, int] = {}
    for line in counters_file.read_text().splitlines():
        for name, value in json.loads(line).items():
            totals[name] = totals.get(name, 0) + value
    assert totals.get("inductor.fxgraph_cache_hit", 0) > 0, totals  # it compiled through the cache, and missed nothing
    assert totals.get("inductor.fxgraph_cache_miss", 0) == 0, totals
    assert totals.get("aot_autograd.autograd_cache_miss", 0) == 0, totals


def test_warm_then_real_run_has_no_cache_miss(warmed_sft: WarmedSFT, tmp_path: Path) -> None:
    plan, cache, report, env = warmed_sft.plan, warmed_sft.cache, warmed_sft.report, warmed_sft.env
    assert [(r["phase"], r["batch"], r["seq"], r["status"]) for r in report["results"]] == [
        ("train", 2, 128, "compiled")]
    assert report["results"][0]["counters"]["fxgraph_cache_miss"] > 0

    run = real_run_in_new_process(cache, report["script_lines"], tmp_path / "run", env)
    counters = run["counters"]
    assert counters.get("inductor.fxgraph_cache_miss", 0) == 0, counters
    assert counters.get("aot_autograd.autograd_cache_miss", 0) == 0, counters
    # ... and the warm-up compiled nothing the run does not use: the run hits every graph the warm-up compiled.
    warmed = report["results"][0]["counters"]
    assert counters.get("inductor.fxgraph_cache_hit") == warmed["fxgraph_cache_miss"], (counters, warmed)
    assert counters.get("aot_autograd.autograd_cache_hit") == warmed["autograd_cache_miss"], (counters, warmed)

    again = shapeplan("warm", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache), "--json", env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["status"] for r in json.loads(again.stdout)["results"]] == ["skipped"]

    verified = shapeplan("verify", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache), "--json",
                         env=env)
    assert verified.returncode == 0, verified.stderr[-3000:]
    results = json.loads(verified.stdout)["results"]
    assert [r["status"] for r in results] == ["cached"]
    assert results[0]["counters"].get("fxgraph_cache_miss", 0) == 0
