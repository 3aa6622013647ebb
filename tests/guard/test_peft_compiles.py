"""A LoRA run under torch.compile (Inductor): after `shapeplan warm` of a `--use_peft` DPO plan, the guarded real
`trl dpo --use_peft` run compiles nothing (no FX-graph or AOTAutograd miss: the adapter matmuls, the frozen base
weights and the reference forward with the adapters disabled are all in the cache), and the guard meets every
forward under a planned phase (its phase rules agree with the trainer's PEFT reference forwards).

DPO's LoRA step holds what any LoRA run adds (PEFT's wrapper, the adapters, the frozen base, the adapters switched
off for the reference); SFT's is the same without the reference forward. GRPO's LoRA generate and reference forwards
are held op by op (tests/warm/test_grpo_opsig.py, `grpo-lora-ref`), and GRPO under Inductor end to end in
test_agentic_compiles.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from shapeplan.plan.io import load_plan
from tests import console
from tests.conftest import ROOT, TINY_MODEL
from tests.guard.test_guard_cli import TRL_RUN

pytestmark = pytest.mark.slow

LORA = {"use_peft": "true", "lora_r": 8, "lora_alpha": 16, "lora_target_modules": "all-linear"}


def test_lora_run_compiles_nothing_after_the_lora_warm_up(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    source = ROOT / "tests" / "fixtures" / "preference-explicit.jsonl"
    (data / "train.jsonl").write_text("".join(source.read_text(encoding="utf-8").splitlines(keepends=True)[:8]),
                                      encoding="utf-8")
    settings = {"dataset_name": data, "model_name_or_path": TINY_MODEL, "bf16": "false", "pad_to_multiple_of": 128,
                "torch_compile": "true", "max_length": 128, "per_device_train_batch_size": 2, "max_steps": 2, **LORA}
    config, plan_path, cache = tmp_path / "dpo.yaml", tmp_path / "plan.json", tmp_path / "cache"
    config.write_text("".join(f"{k}: {v}\n" for k, v in settings.items()), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(cache)}

    def run(*args: str | Path) -> str:
        result = console.run(args, env=env, timeout=1800)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stderr

    run("analyze", "--method", "dpo", "--config", config, "-o", plan_path)
    plan = load_plan(plan_path)
    run("warm", "--plan", plan_path, "--device", "cpu", "--cache-dir", cache)
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    guarded = run("guard", "--plan", plan_path, "--record", tmp_path / "run.json", "--", "trl", "dpo", "--config",
                  config, "--output_dir", tmp_path / "out", *TRL_RUN)
    record = json.loads((tmp_path / "run.json").read_text(encoding="utf-8"))
    assert record["compiles"] == [], record["compiles"]
    summary = next(line for line in guarded.splitlines() if line.startswith("shapeplan: "))
    assert ", 0 unplanned, 0 compiles" in summary, summary
    assert {s["phase"] for s in record["shapes"]} == {s.phase for s in plan.shapes if s.certain}
