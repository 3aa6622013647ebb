"""Warming a vision-language SFT plan: synthetic rows of every planned row layout, with images of the planned grids,
through the run's own trainer, collator and processor. On an eager device the warm-up dispatches exactly the ops of
the real run (Qwen-VL's per-row position ops included); under torch.compile the real run then misses no Inductor
graph."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from shapeplan import analyze
from tests import console
from tests.conftest import ROOT, TINY_VL_MODEL
from tests.oracle.vision_data import write_images, write_rows
from tests.oracle.vision_harness import run_sft_vision
from tests.warm.harness import record, warm_plan

pytestmark = pytest.mark.slow

BASE = ["--bf16", "false", "--report_to", "none", "--save_strategy", "no"]


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_images(tmp_path_factory.mktemp("images"))


def _plan_argv(data: Path, argv: list[str], out: Path) -> list[str]:
    return ["--dataset_name", str(data), "--model_name_or_path", str(TINY_VL_MODEL), *BASE, *argv,
            "--output_dir", str(out)]


def test_warm_dispatches_exactly_the_ops_of_a_real_vision_run(images: list[str], tmp_path: Path) -> None:
    """Rows of 0 to 2 images and text of many lengths (each row's own position-id ops), gradient accumulation,
    a max_length that cuts text after the images: every op signature the real run dispatches, and no other."""
    data = write_rows(tmp_path / "rows.jsonl", images, 8, seed=5)
    argv = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "2",
            "--max_length", "512", "--pad_to_multiple_of", "64"]
    plan = analyze("sft", _plan_argv(data, argv, tmp_path / "out"))
    lengths = []  # each planned row's collated length: its text runs and its images' tokens (2x2 patches merged)
    for shape in plan.shapes:
        for layout in shape.text_runs:
            grids = iter(shape.images)
            lengths += [sum(runs) + sum(t * h * w // 4 for t, h, w in (next(grids) for _ in runs[1:]))
                        for runs in layout]
    assert max(lengths) == 512 and min(lengths) < 256  # some row cut at max_length, others far shorter
    real, _ = record(lambda: run_sft_vision(data, [*argv, "--bf16", "false"], guarded=False))
    warmed, report = record(warm_plan, plan, tmp_path / "cache")
    assert [r.status for r in report.results] == ["eager"] * len(plan.shapes)
    assert real - warmed == set()
    assert warmed - real == set()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_a_warmed_vision_run_misses_no_inductor_graph(family: str, images: list[str], tmp_path: Path) -> None:
    """`shapeplan warm` with torch_compile, then the real run in a new process on that cache: its Inductor graphs
    all come from the cache (the bundled Qwen2.5-VL, and a family whose images are one fixed crop; every family was
    checked so by hand)."""
    from tests.oracle.test_vision_families_oracle import BUILDERS

    model = TINY_VL_MODEL if family == "qwen2_5_vl" else BUILDERS[family](tmp_path / "model")
    data = write_rows(tmp_path / "rows.jsonl", images, 1, seed=7, kind="image")
    argv = ["--per_device_train_batch_size", "1", "--max_steps", "1", "--pad_to_multiple_of", "64",
            "--torch_compile", "true"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plan, cache = tmp_path / "plan.json", tmp_path / "cache"
    analyzed = console.run(["analyze", "--dataset_name", str(data), "--model_name_or_path", str(model), *BASE, *argv,
                            "--output_dir", str(tmp_path / "out"), "-o", str(plan)], env=env)
    assert analyzed.returncode == 0, analyzed.stderr
    warmed = console.run(["warm", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(cache), "--json"],
                         env=env)
    assert warmed.returncode == 0, warmed.stderr[-3000:]
    report = json.loads(warmed.stdout)
    assert [r["status"] for r in report["results"]] == ["compiled"]
    spec = {"data": str(data), "argv": [*argv, "--bf16", "false"], "output_dir": str(tmp_path / "run"),
            "script_lines": report["script_lines"], "vision": True, "model": str(model)}
    python, run_env = console.forked_python({**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
    proc = subprocess.run([*python, "-m", "tests.warm.real_sft", json.dumps(spec)], cwd=ROOT, env=run_env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counters = json.loads(proc.stdout.strip().splitlines()[-1])["counters"]
    assert counters.get("inductor.fxgraph_cache_hit", 0) > 0 and not counters.get("inductor.fxgraph_cache_miss"), \
        counters


@pytest.mark.parametrize("family", ["gemma3", "gemma3-pan-and-scan", "llava", "smolvlm", "smolvlm-one-frame",
                                    "idefics3", "llava_next"])
def test_warm_dispatches_exactly_the_ops_of_a_real_run_of_each_family(family: str, images: list[str],
                                                                      tmp_path: Path) -> None:
    """The families beyond Qwen-VL, each on its tiny model: rows of 0 to 2 images, gradient accumulation: every op
    signature the real run dispatches (its vision tower, its own merging of image features), and no other."""
    from tests.oracle.test_vision_families_oracle import BUILDERS

    model = BUILDERS[family](tmp_path / "model")
    data = write_rows(tmp_path / "rows.jsonl", images, 6, seed=5)
    argv = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_steps", "1",
            "--max_length", "2048", "--pad_to_multiple_of", "64"]
    plan = analyze("sft", ["--dataset_name", str(data), "--model_name_or_path", str(model), *BASE, *argv,
                           "--output_dir", str(tmp_path / "out")])
    real, _ = record(lambda: run_sft_vision(data, [*argv, "--bf16", "false"], model=model, guarded=False))
    warmed, report = record(warm_plan, plan, tmp_path / "cache")
    assert [r.status for r in report.results] == ["eager"] * len(plan.shapes)
    assert real - warmed == set()
    assert warmed - real == set()
