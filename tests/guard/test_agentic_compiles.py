"""An agentic GRPO run under torch.compile (Inductor), as users run one: their own script hands `GRPOTrainer` a
tool, `shapeplan analyze --tools` plans it (tool turns padded to the round's rows, the default), `shapeplan warm`
compiles the plan, and `shapeplan guard -- python train.py` runs the script, padding its tool turns as the plan
says. The tool sends every other row out of the loop, so unpadded the run would generate a turn on one row of two,
a graph the warm-up never made; padded, the guarded run compiles nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shapeplan.plan.io import load_plan
from tests import console
from tests.conftest import ROOT, TINY_MODEL
from tests.guard.test_guard_cli import TRL_RUN
from tests.oracle import agentic_tools

pytestmark = pytest.mark.slow

SCRIPT = """import importlib

import trl
from datasets import load_dataset
from trl.scripts.grpo import make_parser

from tests.oracle.agentic_tools import ticket

script, config, model_args, _ = make_parser().parse_args_and_config()
config.model_init_kwargs = {"revision": model_args.model_revision, "trust_remote_code": config.trust_remote_code,
                            "attn_implementation": model_args.attn_implementation, "dtype": model_args.dtype}
module, name = script.reward_funcs[0].rsplit(".", 1)
trl.GRPOTrainer(model=model_args.model_name_or_path, reward_funcs=[getattr(importlib.import_module(module), name)],
                args=config, train_dataset=load_dataset(script.dataset_name, split="train"), tools=[ticket]).train()
"""


def test_a_guarded_agentic_run_compiles_nothing_after_the_warm_up(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Ticket {i}."}]})
                                              + "\n" for i in range(4)), encoding="utf-8")
    (tmp_path / "my_rewards.py").write_text("def reward_len(completions, **kwargs):\n"
                                            "    return [float(len(c)) for c in completions]\n", encoding="utf-8")
    (tmp_path / "train.py").write_text(SCRIPT, encoding="utf-8")
    generation = {**json.loads(agentic_tools.forced_call(AutoTokenizer.from_pretrained(TINY_MODEL), "ticket", {})),
                  "max_cache_len": 1024}  # pinned: one cache length, the turns included
    settings = {"dataset_name": data, "model_name_or_path": TINY_MODEL, "reward_funcs": "[my_rewards.reward_len]",
                "per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 200,
                "max_tool_calling_iterations": 2, "max_steps": 2, "cache_implementation": "static", "bf16": "false",
                "pad_to_multiple_of": 256, "torch_compile": "true", "generation_kwargs": json.dumps(generation)}
    config = tmp_path / "grpo.yaml"
    config.write_text("".join(f"{k}: {v}\n" for k, v in settings.items()), encoding="utf-8")
    plan_path, cache, record = tmp_path / "plan.json", tmp_path / "cache", tmp_path / "run.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "TORCHINDUCTOR_CACHE_DIR": str(cache)}

    def run(*args: str | Path) -> str:
        result = console.run(args, env=env, cwd=tmp_path, timeout=1800)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stderr

    run("analyze", "--method", "grpo", "--config", config, "--tools", "tests.oracle.agentic_tools:ticket",
        "-o", plan_path)
    plan = load_plan(plan_path)
    assert plan.config["pad_tool_turns"] is True
    assert {s.batch for s in plan.shapes if s.phase == "generate"} == {2}
    run("warm", "--plan", plan_path, "--device", "cpu", "--cache-dir", cache)
    guarded = run("guard", "--plan", plan_path, "--record", record, "--", "python", tmp_path / "train.py", "--config",
                  config, "--output_dir", tmp_path / "out", *TRL_RUN)
    summary = next(line for line in guarded.splitlines() if line.startswith("shapeplan: "))
    assert ", 0 unplanned, 0 compiles" in summary, summary
    met = load_plan(record)
    assert json.loads(record.read_text(encoding="utf-8"))["compiles"] == []
    generates = [s for s in met.shapes if s.phase == "generate"]
    assert {s.batch for s in generates} == {2} and sum(s.count for s in generates) > 2  # tool turns, padded
