"""LoRA runs under torch.compile (Inductor): after `shapeplan warm` of a `--use_peft` plan, the guarded real `trl
<method> --use_peft` run compiles nothing (no FX-graph or AOTAutograd miss: the adapter matmuls, the frozen base
weights, GRPO's generate and the reference forwards with the adapters disabled are all in the cache), and the guard
meets every forward under a planned phase (its phase rules agree with the trainer's PEFT reference forwards)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shapeplan.plan.io import load_plan
from tests import console
from tests.conftest import ROOT, TINY_MODEL, TLDR
from tests.guard.test_guard_cli import TRL_RUN

pytestmark = pytest.mark.slow

LORA = {"use_peft": "true", "lora_r": 8, "lora_alpha": 16, "lora_target_modules": "all-linear"}
# method -> (data, `trl <method> --config` options); one train shape each keeps the compiles few. No SFT: what a
# LoRA run adds (the adapters, the frozen base, PEFT's wrapper) is in DPO's train step too, with the reference
# forward besides, and SFT's own batches are warmed in tests/warm/test_inductor_cache.py
RUNS = {
    # beta > 0: the reference forward runs the policy with its adapters disabled
    "grpo": (TLDR, {"reward_funcs": "[my_rewards.reward_len]", "per_device_train_batch_size": 2, "num_generations": 2,
                    "max_completion_length": 8, "max_steps": 2, "beta": 0.04, "cache_implementation": "static"}),
    "dpo": (ROOT / "tests" / "fixtures" / "preference-explicit.jsonl",
            {"max_length": 128, "per_device_train_batch_size": 2, "max_steps": 2}),
}


def _config(tmp_path: Path, method: str) -> Path:
    source, options = RUNS[method]
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(source.read_text(encoding="utf-8").splitlines(keepends=True)[:8]),
                                      encoding="utf-8")
    (tmp_path / "my_rewards.py").write_text("def reward_len(completions, **kwargs):\n"
                                            "    return [float(len(c)) for c in completions]\n", encoding="utf-8")
    settings = {"dataset_name": data, "model_name_or_path": TINY_MODEL, "bf16": "false", "pad_to_multiple_of": 128,
                "torch_compile": "true", **options, **LORA}
    config = tmp_path / f"{method}.yaml"
    config.write_text("".join(f"{k}: {v}\n" for k, v in settings.items()), encoding="utf-8")
    return config


def _run(*args: str | Path, tmp_path: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    result = console.run(args, env=env, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize("method", sorted(RUNS))
def test_lora_run_compiles_nothing_after_the_lora_warm_up(method: str, tmp_path: Path) -> None:
    config, plan_path, cache = _config(tmp_path, method), tmp_path / "plan.json", tmp_path / "cache"
    _run("analyze", "--method", method, "--config", config, "-o", plan_path, tmp_path=tmp_path, cache=cache)
    plan = load_plan(plan_path)
    _run("warm", "--plan", plan_path, "--device", "cpu", "--cache-dir", cache, tmp_path=tmp_path, cache=cache)
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    guarded = _run("guard", "--plan", plan_path, "--record", tmp_path / "run.json", "--", "trl", method, "--config",
                   config, "--output_dir", tmp_path / "out", *TRL_RUN, tmp_path=tmp_path, cache=cache)
    record = json.loads((tmp_path / "run.json").read_text(encoding="utf-8"))
    assert record["compiles"] == [], record["compiles"]
    summary = next(line for line in guarded.stderr.splitlines() if line.startswith("shapeplan: "))
    assert ", 0 unplanned, 0 compiles" in summary, summary
    assert {s["phase"] for s in record["shapes"]} == {s.phase for s in plan.shapes if s.certain}
