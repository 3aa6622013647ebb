"""DPO, KTO and Reward plans equal what the real trainers feed their models: shapes, counts and first steps of every
phase, how many of each shape's batches hold no padding, and the rows, micro-batches and optimizer steps of the
run."""

from __future__ import annotations

import pytest

from shapeplan.services.analyze import analyze
from tests.conftest import ROOT, TINY_MODEL
from tests.oracle.harness import observed, planned
from tests.oracle.preference_harness import run_preference
from tests.warm.harness import LORA

pytestmark = pytest.mark.slow

FIXTURES = ROOT / "tests" / "fixtures"
CONVERSATIONAL = FIXTURES / "preference-conversational.jsonl"
EXPLICIT = FIXTURES / "preference-explicit.jsonl"
UNPAIRED = FIXTURES / "kto-unpaired.jsonl"

# name -> (method, train data, TRL options, eval data)
CONFIGS = {
    # max_length 256 drops the rows whose prompt reaches it and truncates the rest; eval with the ref forward
    "dpo-explicit-truncate-eval": ("dpo", EXPLICIT, [
        "--per_device_train_batch_size", "4", "--max_length", "256", "--max_steps", "6", "--eval_strategy", "steps",
        "--eval_steps", "3", "--per_device_eval_batch_size", "3"], EXPLICIT),
    # the precompute pass reads train and eval data in order, before training; GA 2 and a partial last batch
    "dpo-conversational-precompute-ga": ("dpo", CONVERSATIONAL, [
        "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2", "--num_train_epochs", "1",
        "--precompute_ref_log_probs", "true", "--eval_strategy", "epoch", "--per_device_eval_batch_size", "5"],
        EXPLICIT),
    # sequences cut at max_length 64, a multiple of 32: batches whose every sequence was cut hold no padding
    "dpo-cut-unpadded": ("dpo", EXPLICIT, [
        "--per_device_train_batch_size", "2", "--max_length", "64", "--pad_to_multiple_of", "32", "--max_steps", "4"],
        None),
    "kto-cut-unpadded": ("kto", UNPAIRED, [
        "--per_device_train_batch_size", "2", "--max_length", "64", "--pad_to_multiple_of", "32", "--max_steps", "4"],
        None),
    "kto-unpaired-truncate-eval": ("kto", UNPAIRED, [
        "--per_device_train_batch_size", "4", "--max_length", "256", "--max_steps", "5", "--eval_strategy", "steps",
        "--eval_steps", "2", "--per_device_eval_batch_size", "4"], UNPAIRED),
    # paired rows unpaired into two; KL rows rotated within train-size groups, also in the eval set
    "kto-paired-precompute-ga": ("kto", CONVERSATIONAL, [
        "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2", "--max_steps", "4",
        "--precompute_ref_log_probs", "true", "--eval_strategy", "steps", "--eval_steps", "3",
        "--per_device_eval_batch_size", "6"], UNPAIRED),
    # a loss without KL term: no KL forwards, and the random order is allowed
    "kto-no-kl-random": ("kto", UNPAIRED, [
        "--loss_type", "apo_zero_unpaired", "--train_sampling_strategy", "random", "--per_device_train_batch_size",
        "2", "--max_steps", "4", "--max_length", "384"], None),
    # max_length 384 drops the rows with a longer side
    "reward-conversational-drop-eval": ("reward", CONVERSATIONAL, [
        "--per_device_train_batch_size", "4", "--max_length", "384", "--max_steps", "5", "--eval_strategy", "steps",
        "--eval_steps", "2", "--per_device_eval_batch_size", "3"], EXPLICIT),
    "reward-explicit-ga-epochs": ("reward", EXPLICIT, [
        "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2", "--num_train_epochs", "1.5"],
        None),
}
# LoRA: no reference model, the reference forwards (KTO's KL rows too, the eval loop's) run the policy with its
# adapters disabled
for _name in ("dpo-explicit-truncate-eval", "kto-unpaired-truncate-eval"):
    _method, _data, _argv, _eval = CONFIGS[_name]
    CONFIGS[f"{_name}-lora"] = (_method, _data, [*_argv, *LORA], _eval)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_equals_real_trainer(name: str) -> None:
    method, data, argv, eval_data = CONFIGS[name]
    plan = analyze(method, ["--dataset_name", str(data), "--model_name_or_path", str(TINY_MODEL), *argv],
                   eval_source=str(eval_data) if eval_data else None)
    run = run_preference(method, data, ["--pad_to_multiple_of", "128", *argv], eval_path=eval_data)
    assert planned(plan, unpadded=True) == observed(run.seen, unpadded=True)
    assert (plan.stats.rows, plan.stats.micro_batches, plan.stats.optimizer_steps) == (
        run.train_rows, sum(s.phase == "train" for s in run.seen), run.optimizer_steps)
