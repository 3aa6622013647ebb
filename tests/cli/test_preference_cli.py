"""Bad input to `shapeplan analyze --method dpo|kto|reward`: one line on stderr naming the problem, and its exit
code."""

from __future__ import annotations

import pytest

from shapeplan.cli import main
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL, TLDR

UNPAIRED = ROOT / "tests" / "fixtures" / "kto-unpaired.jsonl"
EXPLICIT = ROOT / "tests" / "fixtures" / "preference-explicit.jsonl"

CASES = {
    "dpo-without-pairs": (["--method", "dpo", str(TLDR)], 1,
                          "Error: the train dataset has no 'chosen'/'rejected' columns (it has completion, prompt); "
                          "DPO needs 'chosen'/'rejected'"),
    "reward-without-pairs": (["--method", "reward", str(CAPYBARA)], 1,
                             "Error: the train dataset has no 'chosen'/'rejected' or 'chosen_ids'/'rejected_ids' "
                             "columns (it has messages, source); Reward needs 'chosen'/'rejected' or "
                             "'chosen_ids'/'rejected_ids'"),
    "kto-without-labels": (["--method", "kto", str(TLDR)], 1,
                           "Error: the train dataset has no 'prompt'/'completion'/'label' or 'chosen'/'rejected' "
                           "columns (it has completion, prompt); KTO needs 'prompt'/'completion'/'label' or "
                           "'chosen'/'rejected'"),
    "kto-random-order": (["--method", "kto", str(UNPAIRED), "--train_sampling_strategy", "random"], 2,
                         "Error: loss_type='kto' estimates a KL term, which needs --train_sampling_strategy "
                         "sequential (KTO's default)"),
    "dpo-every-prompt-too-long": (["--method", "dpo", str(EXPLICIT), "--max_length", "16"], 1,
                                  "Error: every row of the train dataset was dropped: every prompt reaches "
                                  "max_length=16; raise --max_length"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv, code, message = CASES[name]
    assert main(["analyze", "--model", str(TINY_MODEL), *argv]) == code
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[-1] == message
