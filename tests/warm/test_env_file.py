"""`warm --env-file`: the report's `export` lines as a file a shell sources, values quoted, the same variables as
`--json`'s `environment_variables` (the real warm-up's file: tests/cli/test_exit_codes.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from shapeplan.services.report import render_env_file
from shapeplan.warm.model import WarmReport


def test_sourcing_the_file_sets_every_exported_variable_exactly(tmp_path: Path) -> None:
    lines = ("export TORCH_NEURONX_NEFF_CACHE_DIR=/var/cache/a b", "export NEURON_CC_FLAGS=--model-type transformer",
             "torch._dynamo.config.recompile_limit = 8")  # a line for the script, not the environment
    report = WarmReport(results=(), cache_dir="/var/cache/a b", device="neuron", environment={}, script_lines=lines)
    assert report.environment_variables == {"TORCH_NEURONX_NEFF_CACHE_DIR": "/var/cache/a b",
                                            "NEURON_CC_FLAGS": "--model-type transformer"}
    assert report.to_dict()["environment_variables"] == report.environment_variables
    env_file = tmp_path / "shapeplan.env"
    env_file.write_text(render_env_file(report))
    sourced = subprocess.run(["bash", "-c", '. "$0"; printf "%s\\n" "$TORCH_NEURONX_NEFF_CACHE_DIR" "$NEURON_CC_FLAGS"',
                              env_file], capture_output=True, text=True, check=True)
    assert sourced.stdout.splitlines() == ["/var/cache/a b", "--model-type transformer"]


def test_sourcing_runs_nothing_else_whatever_the_cache_dir_holds(tmp_path: Path) -> None:
    """A cache dir with a newline and a command substitution: the file sets the variables and runs nothing; the
    Python-only setting is a comment, the one an exported variable carries is left out."""
    cache = f"{tmp_path}/a\n$(touch {tmp_path}/ran)`touch {tmp_path}/ran2`'\""
    lines = (f"export TORCHINDUCTOR_CACHE_DIR={cache}", "export TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0",
             "torch._dynamo.config.automatic_dynamic_shapes = False", "torch._dynamo.config.recompile_limit = 12")
    report = WarmReport(results=(), cache_dir=cache, device="cpu", environment={}, script_lines=lines)
    text = render_env_file(report)
    env_file = tmp_path / "shapeplan.env"
    env_file.write_text(text)
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert "# torch._dynamo.config.recompile_limit = 12" in comments
    assert not any("automatic_dynamic_shapes = False" in line for line in comments)
    sourced = subprocess.run(["bash", "-c", '. "$0"; printf "%s\\0" "$TORCHINDUCTOR_CACHE_DIR" '
                              '"$TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES"', env_file],
                             capture_output=True, text=True, check=True)
    assert sourced.stdout.split("\0")[:2] == [cache, "0"]
    assert not (tmp_path / "ran").exists() and not (tmp_path / "ran2").exists()


def test_the_next_step_sources_the_file_where_it_is() -> None:
    """`. NAME` looks a name without a slash up in PATH: the printed next step names the file by a path."""
    from shapeplan.services.report import render_warm
    from shapeplan.services.trl_command import TrlCommand

    report = WarmReport(results=(), cache_dir="/c", device="cpu", environment={},
                        script_lines=("export TORCHINDUCTOR_CACHE_DIR=/c d",))
    command = TrlCommand(words=("trl", "sft", "--dataset_name", "/data dir"), notes=("a note",))
    lines = render_warm(report, verify=False, command=command, env_file="shapeplan.env").splitlines()
    assert "  export TORCHINDUCTOR_CACHE_DIR='/c d'" in lines  # the printed block is quoted as the file is
    assert lines[-2:] == ["  . ./shapeplan.env && trl sft --dataset_name '/data dir'", "note: a note"]
    assert "  . /etc/s.env && trl sft --dataset_name '/data dir'" in render_warm(
        report, verify=False, command=command, env_file="/etc/s.env").splitlines()
