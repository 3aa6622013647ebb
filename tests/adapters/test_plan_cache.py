"""The plan cache: an unchanged `shapeplan analyze` answers from it before importing TRL; any change misses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shapeplan.adapters import plan_cache
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL

# Runs the CLI in a fresh interpreter and reports which heavy modules it imported.
PROBE = """
import json, sys
from shapeplan.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "heavy": sorted(m for m in ("trl", "transformers", "datasets", "torch")
                                                  if m in sys.modules)}), file=sys.stderr)
"""


def _cli(*args: str) -> tuple[dict, dict]:  # type: ignore[type-arg]
    proc = subprocess.run([sys.executable, "-c", PROBE, "analyze", *args, "--json"], cwd=ROOT, env=os.environ,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.slow
def test_unchanged_rerun_is_answered_without_heavy_imports_and_a_changed_dataset_misses(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    shutil.copy(CAPYBARA, data)
    args = (str(data), "--model", str(TINY_MODEL), "--max_steps", "5")

    first, probe = _cli(*args)  # TRL itself only where its parse of its defaults is not kept yet (planning_args)
    assert probe["heavy"] in (["datasets", "torch", "transformers"], ["datasets", "torch", "transformers", "trl"])
    again, probe = _cli(*args)
    assert again == first and probe == {"code": 0, "heavy": []}

    data.write_text("".join(CAPYBARA.read_text().splitlines(keepends=True)[:20]))  # fewer rows: another plan
    changed, probe = _cli(*args)
    assert probe["heavy"] == ["datasets", "torch", "transformers"]  # the plain SFT options: TRL's parse kept
    assert changed["stats"]["rows"] == 20 != first["stats"]["rows"]


def test_key_depends_on_every_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data.jsonl"
    shutil.copy(CAPYBARA, data)
    words = [str(data), "--model", str(TINY_MODEL)]
    key = plan_cache.plan_key("sft", words)
    assert key is not None and key == plan_cache.plan_key("sft", words)
    assert plan_cache.plan_key("grpo", words) != key
    assert plan_cache.plan_key("sft", [*words, "--max_length", "512"]) != key
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    assert plan_cache.plan_key("sft", words) != key
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert plan_cache.plan_key("sft", words) == key
    with data.open("a") as f:
        f.write(CAPYBARA.read_text().splitlines(keepends=True)[0])
    assert plan_cache.plan_key("sft", words) != key


def test_config_file_contents_and_the_paths_it_names_are_part_of_the_key(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    shutil.copy(CAPYBARA, data)
    config = tmp_path / "sft.yaml"
    config.write_text(f"dataset_name: {data}\nmodel_name_or_path: {TINY_MODEL}\n")
    words = ["--config", str(config), "--model", str(TINY_MODEL)]
    key = plan_cache.plan_key("sft", words)
    assert key is not None
    with data.open("a") as f:
        f.write(CAPYBARA.read_text().splitlines(keepends=True)[0])
    assert plan_cache.plan_key("sft", words) != key


def test_hub_ids_and_the_hub_default_model_are_not_cached(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    shutil.copy(CAPYBARA, data)
    assert plan_cache.plan_key("sft", ["trl-lib/Capybara", "--model", str(TINY_MODEL)]) is None
    assert plan_cache.plan_key("sft", [str(data), "--model", "Qwen/Qwen3-0.6B"]) is None
    assert plan_cache.plan_key("sft", [str(data), "--model", "gpt2"]) is None
    assert plan_cache.plan_key("sft", [str(data)]) is None


def test_a_torn_cache_file_is_a_miss(tmp_path: Path) -> None:
    key = "0" * 64
    plan_cache.cache_dir().mkdir(parents=True, exist_ok=True)
    (plan_cache.cache_dir() / f"{key}.json").write_text('{"schema": 1, "method": "sft", "sha')
    assert plan_cache.load(key) is None


def test_what_training_writes_into_output_dir_does_not_change_the_key(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    shutil.copy(CAPYBARA, data)
    config = tmp_path / "sft.yaml"
    config.write_text(f"logging_dir: {tmp_path / 'logs'}\n")
    words = [str(tmp_path), "--model", str(TINY_MODEL), "--output_dir", str(tmp_path / "out"), "--config", str(config)]
    key = plan_cache.plan_key("sft", words)
    for folder in ("out/checkpoint-1", "logs"):  # a finished run's checkpoints and logs, inside the dataset folder
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "model.safetensors").write_text("weights")
    assert key is not None and plan_cache.plan_key("sft", words) == key
    (tmp_path / "more.jsonl").write_text(data.read_text())  # a new file of the dataset folder is still read
    assert plan_cache.plan_key("sft", words) != key
