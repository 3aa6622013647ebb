"""The positional DATASET among TRL options and the `accelerate launch` options TRL passes through; a planned run
read from TRL's parse of the defaults (`planning_args`) as TRL's parser reads it."""

from __future__ import annotations

import dataclasses
import enum
import re
import types
from pathlib import Path
from typing import Any

import pytest

from shapeplan.adapters import trl_args
from shapeplan.adapters.trainer import TrainerSpec
from shapeplan.adapters.trl_args import split_dataset_argument
from shapeplan.errors import UsageError
from shapeplan.services.trainers import TRAINERS
from tests.conftest import TINY_MODEL, write_short_text_rows


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


# --- planning_args: a planned SFT run read from TRL's parse of the defaults -------------------------------------------

def _comparable(value: Any) -> Any:
    """A config value as both reads must agree on: an enum member as its value, text and repr; a nested config
    (AcceleratorConfig) as its fields."""
    if isinstance(value, enum.Enum):
        return ("enum", type(value).__name__, value.name, value.value, str(value), repr(value), f"{value}",
                value == value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ("fields", {item.name: getattr(value, item.name) for item in dataclasses.fields(value)})
    if isinstance(value, types.SimpleNamespace):
        return ("fields", vars(value))
    return (type(value), value)


def _same_run(read: trl_args.TrainingArgs, parsed: trl_args.TrainingArgs) -> None:
    for part in ("script", "training", "model", "dataset_mixture"):
        real, view = getattr(parsed, part), getattr(read, part)
        for name, value in vars(real).items():
            if name.startswith("_") or name == "distributed_state":  # accelerate's state: no value
                continue
            assert _comparable(getattr(view, name)) == _comparable(value), (part, name)
    assert (read.given, read.num_processes, read.agentic) == (parsed.given, parsed.num_processes, parsed.agentic)


PLAIN_RUNS = [
    ["--dataset_name", "d.jsonl", "--model_name_or_path", "m", "--dataset_config", "c", "--model_revision", "r1"],
    ["--dataset-name=d", "--dataset_train_split", "tr", "--dataset-test-split", "te"],
    ["--max_length", "512", "--per_device_train_batch_size", "3", "--per-device-eval-batch-size=5",
     "--gradient_accumulation_steps", "4", "--num_train_epochs", "1.5", "--max_steps", "-3", "--seed", "7"],
    ["--max_length", "None", "--data_seed", "null", "--completion_only_loss", "false", "--eval_packing", "YES"],
    ["--data_seed", "3", "--max_length", " 64", "--num_train_epochs", "2", "--completion_only_loss", "t"],
    ["--packing", "--padding_free", "--max_length", "256", "--shuffle_dataset", "--dataloader_drop_last"],
    ["--packing", "false", "--packing_strategy", "wrapped", "--padding-free=0", "--dataloader_drop_last", "n"],
    ["--packing", "--packing_strategy", "bfd_split", "--max_length", "128", "--max_length", "64"],
    ["--dataset_text_field", "body", "--pad_to_multiple_of", "none"],
    ["--pad_to_multiple_of", "64"], ["--pad_to_multiple_of", "auto"], ["--pad-to-multiple-of=NULL"],
]


@pytest.mark.parametrize("argv", PLAIN_RUNS, ids=[" ".join(a)[:40] for a in PLAIN_RUNS])
def test_planning_args_reads_a_plain_run_as_trls_parser_does(argv: list[str]) -> None:
    spec = TRAINERS["sft"]
    _defaults_written(spec)
    read = trl_args.planning_args(spec, argv)
    assert isinstance(read.training, trl_args.ParsedConfig)
    _same_run(read, trl_args.parse_training_args(spec, argv))


@pytest.mark.parametrize("argv", [
    ["--eval_strategy", "steps", "--eval_steps", "5"],  # a __post_init__ reads it
    ["--num_processes", "2"],  # accelerate's
    ["--max_len", "64"],  # a prefix TRL's parser expands
    ["--config", "sft.yaml"],
    ["data.jsonl"],  # a bare word
    ["--model_name_or_path", "-m"],  # argparse takes no option-like value
], ids=lambda a: " ".join(a))
def test_planning_args_leaves_other_runs_to_trls_parser(argv: list[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = TRAINERS["sft"]
    _defaults_written(spec)
    if "--config" in argv:
        (tmp_path / "sft.yaml").write_text("max_length: 64\n")
        monkeypatch.chdir(tmp_path)
    try:
        expected: Any = trl_args.parse_training_args(spec, argv)
    except UsageError as exc:
        expected = exc
    if isinstance(expected, UsageError):
        with pytest.raises(UsageError, match=re.escape(str(expected))):
            trl_args.planning_args(spec, argv)
    else:
        assert type(trl_args.planning_args(spec, argv).training).__name__ == "SFTConfig"


@pytest.mark.parametrize("argv", [
    ["--max_length", "abc"], ["--num_train_epochs", "nan"], ["--packing", "maybe"], ["--packing_strategy", "best"],
    ["--per_device_train_batch_size", "0"], ["--pad_to_multiple_of", "many"], ["--max_steps"],
], ids=lambda a: " ".join(a))
def test_planning_args_refuses_what_trl_refuses_in_its_words(argv: list[str]) -> None:
    spec = TRAINERS["sft"]
    _defaults_written(spec)
    with pytest.raises(UsageError) as expected:
        trl_args.parse_training_args(spec, argv)
    with pytest.raises(UsageError, match=re.escape(str(expected.value))):
        trl_args.planning_args(spec, argv)


def test_what_the_defaults_file_lacks_is_read_from_trls_parse() -> None:
    spec = TRAINERS["sft"]
    _defaults_written(spec)
    read = trl_args.planning_args(spec, ["--per_device_train_batch_size", "3"])
    parsed = trl_args.parse_training_args(spec, ["--per_device_train_batch_size", "3"])
    assert "train_batch_size" not in vars(read.training)  # a property of TrainingArguments
    assert read.training.train_batch_size == parsed.training.train_batch_size == 3
    assert not hasattr(read.training, "num_generations")  # GRPO's, not SFT's


def test_a_defaults_file_of_another_install_or_environment_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = TRAINERS["sft"]
    _defaults_written(spec)
    path = trl_args._defaults_path(spec)
    assert trl_args._load_defaults(spec) is not None
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # TrainingArguments reads it
    assert trl_args._defaults_path(spec) != path and trl_args._load_defaults(spec) is None
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    path.write_text("{not json")
    assert type(trl_args.planning_args(spec, ["--seed", "1"]).training).__name__ == "SFTConfig"
    trl_args.keep_defaults(spec)
    assert isinstance(trl_args.planning_args(spec, ["--seed", "1"]).training, trl_args.ParsedConfig)  # rewritten


def test_a_plan_from_the_defaults_file_is_trls_byte_for_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planned twice, through TRL's parse (which writes the defaults file), then from the file alone: TRL's parser
    is never called for the second, and the plans are the same bytes."""
    from shapeplan.plan.io import dumps
    from shapeplan.services.analyze import analyze

    rows = write_short_text_rows(tmp_path / "rows.jsonl", 64)
    argv = ["--dataset_name", str(rows), "--model_name_or_path", str(TINY_MODEL), "--max_length", "24",
            "--per_device_train_batch_size", "4", "--num_train_epochs", "2", "--max_steps", "-1", "--seed", "3"]
    for extra in ([], ["--packing", "--pad_to_multiple_of", "none"]):
        planned = dumps(analyze("sft", [*argv, *extra], use_cache=False, progress_bars=False))
        trl_args.keep_defaults(TRAINERS["sft"])
        with monkeypatch.context() as patch:
            patch.setattr(trl_args, "parse_training_args", _no_parse)
            assert dumps(analyze("sft", [*argv, *extra], use_cache=False, progress_bars=False)) == planned


def _defaults_written(spec: TrainerSpec) -> None:
    trl_args.parse_training_args(spec, [])  # TRL's parser imported, as by a run planned through it
    trl_args.keep_defaults(spec)
    assert trl_args._load_defaults(spec) is not None


def _no_parse(*_: Any) -> None:
    raise AssertionError("TRL's parser was called")


@pytest.mark.parametrize("tokens", [
    ["data.jsonl", "--max_length", "512"], ["--max_length", "512", "--packing", "data.jsonl"],
    ["--packing", "true", "data.jsonl"], ["--seed=3", "data.jsonl", "--packing"],
    ["data.jsonl", "--num_processes", "2"],  # an option the defaults file does not know: TRL's and accelerate's parsers
], ids=lambda t: " ".join(t))
def test_the_dataset_is_found_alike_with_the_defaults_file(tokens: list[str]) -> None:
    spec = TRAINERS["sft"]
    without = split_dataset_argument(spec, tokens)
    _defaults_written(spec)
    assert split_dataset_argument(spec, tokens) == without
