"""The length cache: a re-run reads the lengths it stored; a changed input, an unreadable file or --no-cache do not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from shapeplan.adapters import length_cache, lengths
from shapeplan.adapters.sft import prepare_rows
from shapeplan.cli import cli
from shapeplan.services.trainers import TRAINERS
from tests.conftest import CAPYBARA, TINY_MODEL, TLDR


def _inputs(tmp_path: Path, path: Path = TLDR, **options: Any) -> tuple[Any, Any, Any]:
    from datasets import load_dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig

    config = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **options)
    return (load_dataset("json", data_files=str(path), split="train"), AutoTokenizer.from_pretrained(TINY_MODEL),
            config)


def _no_tokenizing(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("lengths were computed instead of read from the cache")

    monkeypatch.setattr(lengths, "fast_prepared_rows", fail)


def _cache_files() -> list[Path]:
    return sorted(length_cache.cache_dir().glob("*.npz"))


def test_rerun_reads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dataset, tokenizer, config = _inputs(tmp_path, max_length=120)
    first = prepare_rows(dataset, tokenizer, config, packing=False, name="train")
    assert len(_cache_files()) == 1
    _no_tokenizing(monkeypatch)
    assert prepare_rows(dataset, tokenizer, config, packing=False, name="train") == first


def test_packed_documents_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dataset, tokenizer, config = _inputs(tmp_path, CAPYBARA, max_length=256, packing=True)
    first = prepare_rows(dataset, tokenizer, config, packing=True, name="train")
    assert first[0].documents is not None
    _no_tokenizing(monkeypatch)
    assert prepare_rows(dataset, tokenizer, config, packing=True, name="train") == first


@pytest.mark.parametrize("change", ["max_length", "completion_only_loss", "eos_token", "chat_template", "dataset"])
def test_a_change_that_changes_lengths_misses(change: str, tmp_path: Path) -> None:
    dataset, tokenizer, config = _inputs(tmp_path, max_length=120)
    prepare_rows(dataset, tokenizer, config, packing=False, name="train")
    if change == "max_length":
        config.max_length = 100
    elif change == "completion_only_loss":
        config.completion_only_loss = False
    elif change == "eos_token":
        config.eos_token = "<|endoftext|>"
    elif change == "chat_template":
        tokenizer.chat_template = tokenizer.chat_template + "\n"
    else:
        dataset = dataset.select(range(1, len(dataset)))  # one row fewer
    prepare_rows(dataset, tokenizer, config, packing=False, name="train")
    assert len(_cache_files()) == 2


def test_unreadable_file_is_recomputed_and_rewritten(tmp_path: Path) -> None:
    dataset, tokenizer, config = _inputs(tmp_path, max_length=120)
    first = prepare_rows(dataset, tokenizer, config, packing=False, name="train")
    [path] = _cache_files()
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # a torn file, as a crash in a non-atomic writer would leave
    assert prepare_rows(dataset, tokenizer, config, packing=False, name="train") == first
    assert path.read_bytes() == whole
    assert not list(length_cache.cache_dir().glob(".tmp-*"))


def test_unwritable_cache_dir_only_costs_speed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SHAPEPLAN_CACHE_DIR", str(blocker))  # a file where the folder should be
    dataset, tokenizer, config = _inputs(tmp_path, max_length=120)
    rows, dropped = prepare_rows(dataset, tokenizer, config, packing=False, name="train")
    assert (rows, dropped) == prepare_rows(dataset, tokenizer, config, packing=False, name="train", use_cache=False)


@pytest.mark.parametrize(("flags", "files"), [([], 1), (["--no-cache"], 0)])
def test_no_cache_flag_bypasses_the_cache(flags: list[str], files: int) -> None:
    result = CliRunner().invoke(cli, ["analyze", str(TLDR), "--model", str(TINY_MODEL), "--json", *flags],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(_cache_files()) == files


def test_no_cache_collides_with_no_trl_or_accelerate_option() -> None:
    from accelerate.commands.launch import launch_command_parser

    from shapeplan.adapters.trl_args import make_parser

    taken = set(make_parser(TRAINERS["sft"])._option_string_actions) | \
        set(launch_command_parser()._option_string_actions)
    assert {"--no-cache", "--no_cache"}.isdisjoint(taken)
