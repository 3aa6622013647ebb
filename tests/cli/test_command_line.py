"""The user's own command line, through the installed console script: a wrapped `trl` / `accelerate launch` command
plans what the same options given directly plan; DATASET beside a `--config` that names one wins, as TRL's command
line wins over its config file; a misspelt option is refused as a typo naming the nearest option."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from shapeplan.services.run import unwrap_command
from tests import console
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL


def _shapeplan(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return console.run(args, cwd=cwd, timeout=600)


def _plan(*args: str | Path) -> dict[str, Any]:
    done = _shapeplan("analyze", "--no-cache", "--json", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "sft.yaml"
    path.write_text(f"model_name_or_path: {TINY_MODEL}\ndataset_name: {CAPYBARA}\nmax_length: 256\n"
                    "per_device_train_batch_size: 4\nmax_steps: 5\n")
    return path


def test_a_wrapped_trl_command_plans_what_its_options_plan(config: Path) -> None:
    direct = _plan("--config", config)
    assert _plan("--", "trl", "sft", "--config", config) == direct
    assert _plan("--", "/usr/local/bin/trl", "sft", "--config", config) == direct


def test_a_wrapped_accelerate_launch_plans_its_launch_options_too(config: Path) -> None:
    direct = _plan("--config", config, "--num_processes", "2")
    assert direct["config"]["num_processes"] == 2
    assert _plan("--", "accelerate", "launch", "--num_processes", "2", "-m", "trl.scripts.sft",
                 "--config", config) == direct


def test_dataset_beside_a_config_naming_one_is_the_one_planned(config: Path, tmp_path: Path) -> None:
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("".join(CAPYBARA.read_text().splitlines(keepends=True)[:20]))
    plan = _plan(fewer, "--config", config)
    assert plan["stats"]["rows"] == 20  # the config's dataset has 96


@pytest.mark.parametrize(("command", "typo", "meant"), [
    ("analyze", "--max_lenght", "--max_length"),
    ("warm", "--cache_dir", "--cache-dir"),
    ("analyze", "--eval_dataset", "--eval-dataset"),
])
def test_a_typo_is_named_with_the_nearest_option(command: str, typo: str, meant: str, config: Path,
                                                 tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    done = _shapeplan(command, "--config", config, typo, "512", cwd=run)
    assert (done.returncode, done.stdout) == (2, "")
    (line,) = done.stderr.splitlines()
    assert typo in line and f"did you mean {meant}?" in line
    assert list(run.iterdir()) == []  # nothing written (warm: no cache dir)


def test_a_wrapped_command_that_runs_no_trl_script_is_refused_in_one_line(config: Path) -> None:
    done = _shapeplan("analyze", "--", "accelerate", "launch", "--num_processes", "2", "train.py", "--config", config)
    assert (done.returncode, len(done.stderr.splitlines())) == (2, 1)
    done = _shapeplan("analyze", "--method", "grpo", "--", "trl", "sft", "--config", config)
    assert (done.returncode, len(done.stderr.splitlines())) == (2, 1)


@pytest.mark.parametrize("words", [
    ["trl", "sft", "--config", "c.yaml"],
    ["accelerate", "launch", "--num_processes", "4", "-m", "trl.scripts.sft", "--config", "c.yaml"],
    ["accelerate", "launch", "--num_processes", "4", "trl", "sft", "--config", "c.yaml"],
    ["accelerate", "launch", "--num_processes", "4", "/x/site-packages/trl/scripts/sft.py", "--config", "c.yaml"],
    ["python", "-m", "trl.scripts.sft", "--config", "c.yaml", "--num_processes", "4"],
])
def test_unwrap_reads_each_way_of_starting_trl(words: list[str]) -> None:
    method, argv = unwrap_command(None, words)
    assert method == "sft"
    assert argv[:2] == ("--config", "c.yaml")
    assert set(argv[2:]) <= {"--num_processes", "4"}


def test_plain_words_are_not_a_wrapped_command() -> None:
    assert unwrap_command(None, ["trl", "--max_length", "8"]) == (None, ("trl", "--max_length", "8"))
    assert unwrap_command("grpo", ["data.jsonl"]) == ("grpo", ("data.jsonl",))


def test_a_config_naming_a_local_model_and_dataset_is_answered_from_the_plan_cache(config: Path,
                                                                                  tmp_path: Path) -> None:
    from shapeplan.adapters import plan_cache

    key = plan_cache.plan_key("sft", ["--config", str(config)])
    assert key is not None
    assert plan_cache.plan_key("sft", ["--config", str(config)]) == key
    with config.open("a") as f:
        f.write("max_steps: 6\n")
    assert plan_cache.plan_key("sft", ["--config", str(config)]) not in (None, key)
    hub = tmp_path / "hub.yaml"
    hub.write_text(f"model_name_or_path: {TINY_MODEL}\ndataset_name: trl-lib/Capybara\noutput_dir: runs/x\n")
    assert plan_cache.plan_key("sft", ["--config", str(hub)]) is None  # only the Hub knows if it changed
    local = tmp_path / "local.yaml"
    local.write_text(f"model_name_or_path: {TINY_MODEL}\ndataset_name: {CAPYBARA}\noutput_dir: runs/x\n")
    assert plan_cache.plan_key("sft", ["--config", str(local)]) is not None  # an output dir is no Hub id
