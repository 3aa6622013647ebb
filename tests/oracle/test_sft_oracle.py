"""The SFT plan equals what the real SFTTrainer feeds the model: shapes, counts and first steps (and, for
padding-free batches, the cu_seq_lens lengths and max_length_q values the model receives)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shapeplan.services.analyze import analyze
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL, TLDR
from tests.oracle.harness import observed, planned, run_distributed, run_sft

pytestmark = pytest.mark.slow

FIXTURES = ROOT / "tests" / "fixtures"
TEXT = FIXTURES / "text.jsonl"
LONG_PROMPTS = FIXTURES / "long-prompts.jsonl"
ASSISTANT_CHAT = FIXTURES / "assistant-chat.jsonl"
PLAIN_CHAT_TEMPLATE = FIXTURES / "plain-chat.jinja"

# name -> (train data, TRL options, eval data). Every config stays small: the tiny model trains at a few steps/s.
CONFIGS: dict[str, tuple[Path, list[str], Path | None]] = {
    # conversational rows through the chat template; eval at every eval_steps multiple and the final step
    "padded-eval": (CAPYBARA, ["--per_device_train_batch_size", "4", "--max_steps", "10", "--eval_strategy", "steps",
                               "--eval_steps", "4", "--per_device_eval_batch_size", "7", "--max_length", "512"],
                    CAPYBARA),
    # prompt-completion rows, gradient accumulation over two epochs with a partial last batch
    "prompt-completion-ga": (TLDR, ["--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2",
                                    "--num_train_epochs", "2", "--max_length", "256"], None),
    # plain-text rows truncated at max_length; 30 rows in batches of 4 (a partial batch), 3 micro-batches a step
    "text-truncated-partial": (TEXT, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "3",
                                      "--num_train_epochs", "2", "--max_length", "128", "--pad_to_multiple_of", "32"],
                               None),
    # completion-only loss drops rows whose prompt fills max_length (train and eval), partial eval batches
    "completion-only-drops": (LONG_PROMPTS, ["--per_device_train_batch_size", "4", "--max_length", "64",
                                             "--pad_to_multiple_of", "16", "--eval_strategy", "steps",
                                             "--eval_steps", "2", "--per_device_eval_batch_size", "5"], LONG_PROMPTS),
    # assistant-only loss (training chat template swapped in) drops rows with no assistant token left; no padding
    "assistant-only-drops-unpadded": (ASSISTANT_CHAT, ["--assistant_only_loss", "--max_length", "96",
                                                       "--per_device_train_batch_size", "3",
                                                       "--pad_to_multiple_of", "none"], None),
    # a chat template of the user's own (--chat_template_path FILE.jinja) instead of the tokenizer's
    "own-chat-template": (ASSISTANT_CHAT, ["--chat_template_path", str(PLAIN_CHAT_TEMPLATE), "--max_length", "160",
                                           "--per_device_train_batch_size", "4", "--pad_to_multiple_of", "32"], None),
    # bfd packing is padding-free: (1, R(sum)); packed eval at a fractional eval_steps after eval_delay
    "packing-bfd-eval": (CAPYBARA, ["--packing", "--max_length", "256", "--per_device_train_batch_size", "2",
                                    "--pad_to_multiple_of", "64", "--max_steps", "8", "--eval_strategy", "steps",
                                    "--eval_steps", "0.25", "--eval_delay", "3", "--per_device_eval_batch_size", "4"],
                         CAPYBARA),
    # bfd packing for train only: eval rows stay unpacked (truncated) but are still collated padding-free
    "packing-bfd-eval-unpacked": (TLDR, ["--packing", "--eval_packing", "false", "--max_length", "128",
                                         "--per_device_train_batch_size", "2", "--pad_to_multiple_of", "32",
                                         "--max_steps", "3", "--eval_strategy", "steps", "--eval_steps", "3",
                                         "--per_device_eval_batch_size", "8"], TLDR),
    # bfd_split splits rows longer than max_length into documents of their own
    "packing-bfd-split": (TLDR, ["--packing", "--packing_strategy", "bfd_split", "--max_length", "96",
                                 "--per_device_train_batch_size", "2", "--pad_to_multiple_of", "32",
                                 "--max_steps", "12"], None),
    # wrapped packing with the padded collator; max_length not a multiple of pad_to_multiple_of
    "packing-wrapped": (TEXT, ["--packing", "--packing_strategy", "wrapped", "--max_length", "100",
                               "--per_device_train_batch_size", "3", "--pad_to_multiple_of", "32"], None),
    # padding-free without packing (max_length none), eval padding-free too
    "padding-free-unpacked": (TLDR, ["--padding_free", "--max_length", "none", "--per_device_train_batch_size", "4",
                                     "--pad_to_multiple_of", "64", "--max_steps", "6", "--eval_strategy", "steps",
                                     "--eval_steps", "4", "--per_device_eval_batch_size", "16"], TEXT),
    # dataloader_drop_last (train and eval), fractional epochs cut mid-epoch, eval at each epoch end
    "drop-last-fractional-epochs": (CAPYBARA, ["--per_device_train_batch_size", "5", "--dataloader_drop_last",
                                               "--num_train_epochs", "1.5", "--gradient_accumulation_steps", "2",
                                               "--max_length", "128", "--pad_to_multiple_of", "32",
                                               "--eval_strategy", "epoch", "--per_device_eval_batch_size", "7"],
                                    CAPYBARA),
    # sequential order, eval before training and at every epoch end
    "sequential-eval-on-start": (TLDR, ["--train_sampling_strategy", "sequential", "--num_train_epochs", "2",
                                        "--per_device_train_batch_size", "8", "--max_length", "128",
                                        "--pad_to_multiple_of", "32", "--eval_strategy", "epoch", "--eval_on_start",
                                        "--per_device_eval_batch_size", "16"], TLDR),
    # datasets' own shuffle in preparation (shuffle_dataset) with a seed, and a separate data_seed for the sampler
    "shuffle-dataset-seeds": (CAPYBARA, ["--shuffle_dataset", "--seed", "7", "--data_seed", "3", "--max_length", "192",
                                         "--per_device_train_batch_size", "4", "--max_steps", "6",
                                         "--pad_to_multiple_of", "64"], None),
    # batch_rebalance: TRL's rank-aware sampler balancing micro-batch cost, with its own fixed seed
    "batch-rebalance": (CAPYBARA, ["--train_sampling_strategy", "batch_rebalance", "--per_device_train_batch_size", "4",
                                   "--gradient_accumulation_steps", "3", "--max_length", "512", "--max_steps", "6",
                                   "--pad_to_multiple_of", "32"], None),
    # wrapped packing collated padding-free: each packed row is one document
    "packing-wrapped-padding-free": (TEXT, ["--packing", "--packing_strategy", "wrapped", "--padding_free",
                                            "--max_length", "128", "--per_device_train_batch_size", "2",
                                            "--pad_to_multiple_of", "64"], None),
}


def _plan(data: Path, argv: list[str], eval_data: Path | None):  # type: ignore[no-untyped-def]
    return analyze("sft", ["--dataset_name", str(data), "--model_name_or_path", str(TINY_MODEL), *argv],
                   eval_source=str(eval_data) if eval_data else None)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_equals_real_trainer(name: str) -> None:
    data, argv, eval_data = CONFIGS[name]
    plan = _plan(data, argv, eval_data)
    seen = run_sft(data, ["--pad_to_multiple_of", "128", *argv], eval_path=eval_data)
    assert plan.exact
    assert planned(plan, varlen=True, unpadded=True) == observed(seen, varlen=True, unpadded=True)
    train = [s for s in seen if s.phase == "train"]
    assert (plan.stats.micro_batches, plan.stats.optimizer_steps) == (len(train), max(s.step for s in train))


def test_rows_dropped_in_preparation_are_counted() -> None:
    """completion-only loss with max_length 64 drops the 8 rows whose prompt is longer (every third row)."""
    data, argv, eval_data = CONFIGS["completion-only-drops"]
    plan = _plan(data, argv, eval_data)
    assert (plan.stats.rows, plan.stats.dropped_rows) == (16, 8)


UNREPLAYABLE = {
    "group-by-length": ["--train_sampling_strategy", "group_by_length"],
    "unseeded-random-sampler": ["--accelerator_config", '{"use_seedable_sampler": false}'],
}


@pytest.mark.parametrize("name", sorted(UNREPLAYABLE))
def test_unreplayable_order_plan_bounds_the_real_trainer(name: str) -> None:
    """group_by_length (and torch's own RandomSampler) draw the train order from the global RNG: the plan is the
    set of reachable shapes, each with the most micro-batches and the earliest step it can have. The eval order
    does not depend on it (group_by_length seeds its eval sampler), so eval stays exact."""
    argv = [*UNREPLAYABLE[name], "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--max_steps", "6", "--max_length", "256",
            "--pad_to_multiple_of", "64", "--eval_strategy", "steps", "--eval_steps", "3",
            "--per_device_eval_batch_size", "6"]
    plan = _plan(CAPYBARA, argv, CAPYBARA)
    seen = run_sft(CAPYBARA, argv, eval_path=CAPYBARA)
    assert not plan.exact
    got = observed(seen)
    bound = planned(plan)
    for key, (count, first_step) in got.items():
        assert key in bound, key
        assert count <= bound[key][0] and first_step >= bound[key][1], (key, got[key], bound[key])
    assert {k: v for k, v in bound.items() if k[0] == "eval"} == {k: v for k, v in got.items() if k[0] == "eval"}
    train = [s for s in seen if s.phase == "train"]
    assert (plan.stats.micro_batches, plan.stats.optimizer_steps) == (len(train), 6)


def test_two_process_plan_equals_real_trainer(tmp_path: Path) -> None:
    """2 data-parallel ranks (gloo on CPU): even batches wrap around to the epoch's start; counts are summed
    over ranks and shapes are the union of the ranks' shapes."""
    argv = ["--per_device_train_batch_size", "5", "--gradient_accumulation_steps", "3", "--num_train_epochs", "2",
            "--max_length", "128", "--pad_to_multiple_of", "32", "--eval_strategy", "steps", "--eval_steps", "5",
            "--per_device_eval_batch_size", "7"]
    plan = _plan(CAPYBARA, [*argv, "--num-processes", "2"], CAPYBARA)
    seen = run_distributed(CAPYBARA, argv, eval_path=CAPYBARA, num_processes=2, tmp_dir=tmp_path)
    assert {s.rank for s in seen} == {0, 1}
    assert planned(plan) == observed(seen)
