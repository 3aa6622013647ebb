"""Bad input to `shapeplan analyze --method distillation`: one line on stderr naming the problem, and its exit code."""

from __future__ import annotations

import pytest

from shapeplan.cli import main
from tests import console
from tests.conftest import CAPYBARA, TINY_MODEL, TLDR

TEACHER = ["--teacher_model_name_or_path", str(TINY_MODEL)]
CASES = {
    "no-teacher": ([str(TLDR)], 2,
                   "Error: a teacher model is required for distillation, as `trl distillation` requires; pass "
                   "--teacher_model_name_or_path"),
    "vllm": ([str(TLDR), *TEACHER, "--use_vllm", "true"], 2,
             "Error: use_vllm=True is not planned: vLLM does not run on Neuron; drop --use_vllm to generate with "
             "transformers"),
    "no-prompt-column": ([str(CAPYBARA), *TEACHER], 1,
                         "Error: the train dataset has no 'prompt' column (it has source, messages); GRPO, RLOO and "
                         "Distillation generate from 'prompt': rename the column or pass another dataset"),
    "fewer-prompts-than-a-round": ([str(TLDR), *TEACHER, "--per_device_train_batch_size", "16",
                                    "--gradient_accumulation_steps", "8"], 1,
                                   "Error: the train dataset has 64 prompts, fewer than one generation batch holds "
                                   "(128 unique prompts); add prompts or lower the batch"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv, code, message = CASES[name]
    assert main(["analyze", "--model", str(TINY_MODEL), "--method", "distillation", *argv]) == code
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[-1] == message


def test_tools_on_plain_string_prompts_are_refused_at_analyze_in_one_line() -> None:
    """Through the console script: DistillationTrainer's tool loop reads each completion as chat messages, as
    GRPO's does, so `--tools` on plain-string prompts is refused before any trainer is built (exit 2)."""
    refused = console.run(["analyze", "--method", "distillation", TLDR, "--model", TINY_MODEL, *TEACHER,
                           "--tools", "tests.oracle.agentic_tools:get_weather"])
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("Error: --tools needs conversational prompts, and the train dataset's are plain "
                                     "strings") and '[{"role": "user", "content": "..."}]' in refused.stderr
