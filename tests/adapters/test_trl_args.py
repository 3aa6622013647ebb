"""The positional DATASET among TRL options and the `accelerate launch` options TRL passes through."""

from __future__ import annotations

import pytest

from shapeplan.adapters.trl_args import split_dataset_argument
from shapeplan.services.trainers import TRAINERS


@pytest.mark.parametrize("tokens, dataset", [
    (["data.jsonl", "--num_processes", "2"], "data.jsonl"),
    (["--num_processes", "2", "data.jsonl"], "data.jsonl"),  # a launch option's value is no dataset
    (["--num_processes", "2", "--dataset_name", "d"], None),
    (["--multi_gpu", "data.jsonl", "--mixed_precision", "bf16"], "data.jsonl"),  # a flag takes no value
    (["--max_length", "512", "--packing", "data.jsonl"], "data.jsonl"),  # --packing's optional bool left out
    (["--packing", "true", "data.jsonl"], "data.jsonl"),
    (["--reward_funcs", "a", "b", "--max_steps", "3"], None),  # a list option's values
])
def test_the_dataset_is_the_first_token_no_option_takes(tokens: list[str], dataset: str | None) -> None:
    found, rest = split_dataset_argument(TRAINERS["grpo" if "--reward_funcs" in tokens else "sft"], tokens)
    assert found == dataset
    assert rest == [t for t in tokens if t != dataset]
