"""GRPO and RLOO plans equal what the real trainers feed the models: generate sizes with their static cache length,
train / old_logprob / ref / eval forwards, counts and first steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shapeplan.services.analyze import analyze
from tests.conftest import CAPYBARA, TINY_MODEL, TLDR
from tests.oracle.grpo_harness import observed, planned, run_generation_trainer
from tests.warm.harness import LORA

pytestmark = pytest.mark.slow

STATIC = ["--cache_implementation", "static"]
# name -> (method, train rows, eval rows (None: no eval), TRL options); rows are lines of TLDR.
# Rows 24-39 hold prompts of every bucket from 128 to 512 tokens (the tiny tokenizer), so the static cache grows.
MIXED = slice(24, 40)
CONFIGS = {
    "steps-per-generation": ("grpo", 16, None, [
        "--per_device_train_batch_size", "2", "--num_generations", "4", "--steps_per_generation", "2",
        "--max_completion_length", "32", "--max_steps", "5", *STATIC]),
    "iterations-beta": ("grpo", 16, None, [
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--gradient_accumulation_steps", "2",
        "--num_iterations", "2", "--beta", "0.1", "--max_completion_length", "16", "--max_steps", "4", *STATIC]),
    "cache-growth": ("grpo", MIXED, None, [
        "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "16",
        "--max_steps", "8", *STATIC]),
    # max_cache_len is a floor: a prompt bucket of 512 still grows the cache past it
    "pinned-cache-floor": ("grpo", MIXED, None, [
        "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "16",
        "--generation_kwargs", json.dumps({"max_cache_len": 450}), "--max_steps", "8", *STATIC]),
    "two-epochs": ("grpo", 10, None, [
        "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8",
        "--num_train_epochs", "2", *STATIC]),
    "eval": ("grpo", 16, 5, [
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "32",
        "--max_steps", "4", "--eval_strategy", "steps", "--eval_steps", "2", "--eval_on_start", "true",
        "--per_device_eval_batch_size", "4", "--num_generations_eval", "2", "--beta", "0.05", *STATIC]),
    "rloo-static": ("rloo", 16, None, [
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_completion_length", "64",
        "--max_steps", "3", *STATIC]),
    # Unpadded (multiple 1) and one-token completions: every prompt length shows, the chat template's included.
    "conversational": ("grpo", "conversational", None, [
        "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "1",
        "--pad_to_multiple_of", "1", "--max_steps", "4", *STATIC]),
    "rloo-conversational": ("rloo", "conversational", None, [
        "--per_device_train_batch_size", "2", "--max_completion_length", "1", "--pad_to_multiple_of", "1",
        "--beta", "0", "--max_steps", "3", *STATIC]),
    "grpo-dynamic-cache": ("grpo", 16, None, [
        "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "16",
        "--max_steps", "3"]),
}
# LoRA: generate runs the model inside the PeftModel, the reference forwards the policy with its adapters disabled
CONFIGS["eval-lora"] = (*CONFIGS["eval"][:3], [*CONFIGS["eval"][3], *LORA])
# Completions longer than one padding multiple: C depends on sampling, the prompt side stays exact.
SAMPLED = {
    "completion-256": ("grpo", 16, None, [
        "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "256",
        "--max_steps", "3", "--beta", "0.1", *STATIC]),
    # TRL's RLOO defaults (2 generations, beta 0.05, 512 new tokens, dynamic cache) on a smaller batch
    "rloo-defaults": ("rloo", 16, None, ["--per_device_train_batch_size", "2", "--max_steps", "2"]),
}


def _conversational_prompts(path: Path, rows: int) -> Path:
    """Prompts as conversations (the first user turn of CAPYBARA rows), tokenized through the chat template."""
    lines = CAPYBARA.read_text(encoding="utf-8").splitlines()[:rows]
    prompts = [{"prompt": json.loads(line)["messages"][:1]} for line in lines]
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts), encoding="utf-8")
    return path


def _rows(path: Path, rows: int | slice) -> Path:
    lines = TLDR.read_text(encoding="utf-8").splitlines()[rows if isinstance(rows, slice) else slice(rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _plan_and_run(name: str, configs: dict, tmp_path: Path):  # type: ignore[no-untyped-def,type-arg]
    method, train_rows, eval_rows, argv = configs[name]
    if train_rows == "conversational":
        train = _conversational_prompts(tmp_path / "train.jsonl", 12)
    else:
        train = _rows(tmp_path / "train.jsonl", train_rows)
    eval_data = _rows(tmp_path / "eval.jsonl", eval_rows) if eval_rows else None
    plan = analyze(method, ["--dataset_name", str(train), "--model_name_or_path", str(TINY_MODEL), *argv],
                   eval_source=str(eval_data) if eval_data else None)
    seen = run_generation_trainer(method, train, ["--pad_to_multiple_of", "128", *argv], eval_path=eval_data)
    return plan, seen


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_equals_real_trainer(name: str, tmp_path: Path) -> None:
    plan, seen = _plan_and_run(name, CONFIGS, tmp_path)
    assert all(s.certain for s in plan.shapes)
    assert planned(plan) == observed(seen)


@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampled_completions_are_planned_possibilities(name: str, tmp_path: Path) -> None:
    plan, seen = _plan_and_run(name, SAMPLED, tmp_path)
    seen_map = observed(seen)
    generate = {"generate", "eval_generate"}
    assert {k: v for k, v in planned(plan).items() if k[0] in generate} == \
        {k: v for k, v in seen_map.items() if k[0] in generate}
    possible = planned(plan)
    for key, (count, first_step) in seen_map.items():
        if key[0] in generate:
            continue
        assert key in possible, key
        assert count <= possible[key][0] and first_step >= possible[key][1], key
    assert any(not s.certain for s in plan.shapes)
