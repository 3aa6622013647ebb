"""`shapeplan guard -- COMMAND` through the installed console script: it guards a real `trl sft --config` run
in-process (summary line, run record), exits 4 before the forward of an unplanned shape with `--on-unplanned error`,
guards every rank under `accelerate launch`, and refuses bad invocations with one line."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shapeplan.plan.io import load_plan, write_plan
from tests.cli.test_exit_codes import refused, shapeplan
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL, TLDR

TRL_RUN = ["--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--disable_tqdm", "true"]


def _sft_config(tmp_path: Path) -> Path:
    """A `trl sft --config` file over a local data folder (`trl sft` loads a dataset by name or folder)."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(CAPYBARA, data / "train.jsonl")
    config = tmp_path / "sft.yaml"
    config.write_text(f"dataset_name: {data}\nmodel_name_or_path: {TINY_MODEL}\nper_device_train_batch_size: 4\n"
                      "max_steps: 6\nmax_length: 512\npad_to_multiple_of: 64\nbf16: false\n", encoding="utf-8")
    return config


@pytest.mark.slow
def test_guard_runs_trl_sft_in_process(tmp_path: Path) -> None:
    config = _sft_config(tmp_path)
    plan_path = tmp_path / "plan.json"
    assert shapeplan("analyze", "--config", config, "-o", plan_path).returncode == 0
    plan = load_plan(plan_path)
    result = shapeplan("guard", "--plan", plan_path, "--record", tmp_path / "run.json", "--", "trl", "sft",
                       "--config", config, "--output_dir", tmp_path / "out", *TRL_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    n = len(plan.shapes)
    assert f"shapeplan: {n}/{n} planned shapes met, 0 unplanned, 0 compiles, counts as planned" in \
        result.stderr.splitlines()
    record = load_plan(tmp_path / "run.json")
    assert record.observed and record.config == plan.config
    assert {(s.key, s.count, s.first_step) for s in record.shapes} == \
        {(s.key, s.count, s.first_step) for s in plan.shapes}

    # --on-unplanned error: the run stops before the forward of the shape the plan lacks, with exit code 4
    removed = max((s for s in plan.shapes if s.phase == "train"), key=lambda s: s.first_step)
    assert removed.first_step > 1
    write_plan(dataclasses.replace(plan, shapes=tuple(s for s in plan.shapes if s is not removed)), plan_path)
    result = shapeplan("guard", "--plan", plan_path, "--on-unplanned", "error", "--", "trl", "sft",
                       "--config", config, "--output_dir", tmp_path / "out", *TRL_RUN)
    assert result.returncode == 4, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        f"Error: unplanned shape train ({removed.batch}, {removed.seq}) at step {removed.first_step} (rank 0)")


def test_guard_refuses_bad_invocations(tmp_path: Path) -> None:
    usage = "give the training command after `--`: `trl sft ARGS`, `python train.py ARGS`, `train.py ARGS` or " \
            "`python -m MODULE ARGS`"
    refused(shapeplan("guard"), 2, f"no training command; {usage}")
    refused(shapeplan("guard", "--", "python"), 2, f"no training command; {usage}")
    refused(shapeplan("guard", "--", "missing.py"), 2, f"training script missing.py not found; {usage}")
    refused(shapeplan("guard", "--", "ls", "-l"), 2, f"cannot run 'ls -l' in-process; {usage}")
    refused(shapeplan("guard", "--plan", tmp_path / "none.json", "--", "train.py"), 1,
            f"cannot read plan {tmp_path / 'none.json'}: No such file or directory; pass a file written by "
            "`shapeplan analyze -o`")


def test_a_trl_command_the_run_would_refuse_is_one_line_with_its_fix(tmp_path: Path) -> None:
    """Refused before the run: TRL's default bf16 on a machine without an accelerator, and a data file as
    --dataset_name, which `trl sft` cannot load (a folder of data files it can)."""
    config = _sft_config(tmp_path)
    config.write_text(config.read_text().replace("bf16: false\n", ""))
    result = shapeplan("guard", "--", "trl", "sft", "--config", config, "--output_dir", tmp_path / "out",
                       "--report_to", "none")
    assert (result.returncode, result.stdout, len(result.stderr.splitlines())) == (2, "", 1), result.stderr[-3000:]
    assert "--use_cpu true" in result.stderr
    result = shapeplan("guard", "--", "trl", "sft", "--config", config, "--dataset_name", CAPYBARA,
                       "--output_dir", tmp_path / "out", *TRL_RUN)
    assert (result.returncode, result.stdout, len(result.stderr.splitlines())) == (2, "", 1), result.stderr[-3000:]
    assert str(CAPYBARA) in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_drift_the_device_makes_names_its_cause(tmp_path: Path) -> None:
    """On CPU TRL resolves pad_to_multiple_of="auto" to None; the plan (for Neuron) pads to 128: the drift line
    names the padding, not a re-plan."""
    config = _sft_config(tmp_path)
    config.write_text(config.read_text().replace("pad_to_multiple_of: 64\n", "").replace("max_steps: 6",
                                                                                         "max_steps: 3")
                      .replace("max_length: 512", "max_length: 2048"))  # untruncated: unpadded lengths are unplanned
    plan_path = tmp_path / "plan.json"
    assert shapeplan("analyze", "--config", config, "-o", plan_path).returncode == 0
    with_bars = [word for word in TRL_RUN if word not in ("--disable_tqdm", "true")] + ["--disable_tqdm", "false"]
    result = shapeplan("guard", "--plan", plan_path, "--", "trl", "sft", "--config", config,
                       "--output_dir", tmp_path / "out", *with_bars)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    (drift,) = [line for line in lines if "drift:" in line]
    assert "pad_to_multiple_of=128" in drift and "--pad_to_multiple_of 128" in drift and "re-plan" not in drift
    # after it, every line says the same: the drift is why, and eager CPU compiled nothing
    unplanned = [line for line in lines if "unplanned shape" in line]
    assert unplanned and all("0 compiles" in line and "the drift above is why" in line for line in unplanned)
    assert not any("compiles now" in line or "re-plan" in line or "stale" in line for line in lines), lines
    (summary,) = [line for line in result.stderr.split("\n") if "planned shapes met" in line]  # not after a bar
    assert summary.startswith("shapeplan: ") and ", 0 compiles" in summary, summary


@pytest.mark.slow
def test_accelerate_launch_guards_every_rank(tmp_path: Path) -> None:
    """`accelerate launch --num_processes 2 -m shapeplan guard`: both ranks guarded (gloo on CPU), their shapes
    merged into one record on rank 0, which prints the one summary."""
    config = _sft_config(tmp_path)
    plan_path, record = tmp_path / "plan.json", tmp_path / "run.json"
    assert shapeplan("analyze", "--num_processes=2", "--config", config, "-o", plan_path).returncode == 0
    plan = load_plan(plan_path)
    launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    result = subprocess.run([*launch, "-m", "shapeplan", "guard", "--plan", str(plan_path), "--record", str(record),
                             "--", "trl", "sft", "--config", str(config), "--output_dir", str(tmp_path / "out"),
                             *TRL_RUN], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                            text=True, timeout=1200, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    n = len(plan.shapes)
    summaries = [line for line in result.stderr.splitlines() if line.startswith("shapeplan: ")]
    assert summaries == [f"shapeplan: {n}/{n} planned shapes met, 0 unplanned, 0 compiles, counts as planned"]
    assert {(s.key, s.count, s.first_step) for s in load_plan(record).shapes} == \
        {(s.key, s.count, s.first_step) for s in plan.shapes}


def grpo_config(tmp_path: Path, *extra: str) -> Path:
    """A `trl grpo --config` file: 8 prompts, completions up to 256 tokens (their buckets depend on sampling), a
    reward function by import path (`my_rewards` in tmp_path, which must be on PYTHONPATH)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(TLDR.read_text(encoding="utf-8").splitlines(keepends=True)[:8]))
    (tmp_path / "my_rewards.py").write_text("def reward_len(completions, **kwargs):\n"
                                            "    return [float(len(c)) for c in completions]\n")
    config = tmp_path / "grpo.yaml"
    config.write_text(f"dataset_name: {data}\nmodel_name_or_path: {TINY_MODEL}\nreward_funcs: [my_rewards.reward_len]\n"
                      "per_device_train_batch_size: 2\nnum_generations: 2\nmax_completion_length: 256\nmax_steps: 2\n"
                      "cache_implementation: static\nbf16: false\npad_to_multiple_of: 128\n" + "".join(
                          f"{line}\n" for line in extra), encoding="utf-8")
    return config


@pytest.mark.slow
def test_grpo_run_record_is_compared_and_warmed(tmp_path: Path) -> None:
    """A guarded `trl grpo` run whose completion buckets depend on sampling: its record holds the buckets it sampled,
    `analyze --compare` shows them against the plan's possibilities, and `shapeplan warm --plan RUN` warms it."""
    config = grpo_config(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}

    def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([str(Path(sys.executable).parent / "shapeplan"), *map(str, args)], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=1200, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    plan_path, record = tmp_path / "plan.json", tmp_path / "run.json"
    run("analyze", "--method", "grpo", "--config", config, "-o", plan_path)
    plan = load_plan(plan_path)
    possible = [s for s in plan.shapes if not s.certain]
    assert possible and all(s.phase == "train" for s in possible)
    guarded = run("guard", "--plan", plan_path, "--record", record, "--", "trl", "grpo", "--config", config,
                  "--output_dir", tmp_path / "out", *TRL_RUN)
    observed = load_plan(record)
    sampled = [s for s in observed.shapes if s.phase == "train"]
    assert {s.key for s in sampled} < {s.key for s in possible}  # one bucket per round, out of several possible
    certain = len(plan.shapes) - len(possible)
    assert f"shapeplan: {certain}/{certain} planned shapes met (and {len(sampled)}/{len(possible)} possible ones), " \
           "0 unplanned, 0 compiles, counts as planned" in guarded.stderr.splitlines()

    compared = run("analyze", "--method", "grpo", "--config", config, "--compare", record).stdout.splitlines()
    met = [line.split()[:3] for line in compared if line.split()[7:8] == ["met"]]  # a possible shape the run met
    assert sorted(met) == sorted(["train", str(s.batch), str(s.seq)] for s in sampled)

    warmed = json.loads(run("warm", "--plan", record, "--device", "cpu", "--cache-dir", tmp_path / "cache",
                            "--json").stdout)
    assert [(r["phase"], r["batch"], r["seq"]) for r in warmed["results"]] == [
        ("generate", s.batch, s.seq) for s in observed.shapes if s.phase == "generate"]
    assert {r["status"] for r in warmed["results"]} == {"eager"}  # eager on CPU: run, nothing to compile


@pytest.mark.slow
def test_the_printed_trl_command_of_a_pinned_plan_pins_the_real_runs_cache(tmp_path: Path) -> None:
    """A run with tools is planned with its cache pinned; the `trl grpo` command warm prints for it (which cannot
    pass the tools, and says so) carries the pin in --generation_kwargs, and run as printed, under a guard that only
    records, every generate of the real run is at the plan's one cache length (unpinned, its short and long prompts'
    calls would be at two)."""
    from shapeplan.services.trl_command import training_command

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": "hello " * words}]}) + "\n"
                            for words in (1, 150)), encoding="utf-8")
    options = ["--per_device_train_batch_size", "2", "--num_generations", "2", "--max_steps", "2",
               "--max_completion_length", "32", "--cache_implementation", "static", "--shuffle_dataset", "false",
               "--max_tool_calling_iterations", "1"]
    plan_path, record = tmp_path / "plan.json", tmp_path / "run.json"
    analyzed = shapeplan("analyze", "--method", "grpo", data, "--model", TINY_MODEL, *options, "--tools",
                         "tests.oracle.agentic_tools:now", "-o", plan_path)
    assert analyzed.returncode == 0, analyzed.stderr
    plan = load_plan(plan_path)
    pin = plan.config["pin_cache"]
    command = training_command(plan, str(plan_path), eval_source=None, device="cpu", python_lines=())
    assert command is not None and command.words[:2] == ("trl", "grpo")
    assert json.loads(command.words[command.words.index("--generation_kwargs") + 1]) == {"max_cache_len": pin}
    assert "cannot pass tools=['now']" in command.notes[0]
    # as printed; only where the run writes, and its reports, added
    done = shapeplan("guard", "--record", record, "--", *command.words, "--output_dir", tmp_path / "out",
                     "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true")
    assert done.returncode == 0, done.stderr[-3000:]
    generates = [s for s in load_plan(record).shapes if s.phase == "generate"]
    assert len({s.seq for s in generates}) == 2 and {s.cache_len for s in generates} == {pin}


@pytest.mark.slow
def test_guard_runs_a_python_script(tmp_path: Path) -> None:
    """`-- python train.py ARGS`: the script runs as `__main__` with its own argv; its SFTTrainer is guarded."""
    options = ["--per_device_train_batch_size", "4", "--max_steps", "3", "--max_length", "256",
               "--pad_to_multiple_of", "64", "--bf16", "false"]
    plan_path = tmp_path / "plan.json"
    assert shapeplan("analyze", CAPYBARA, "--model", TINY_MODEL, *options, "-o", plan_path).returncode == 0
    script = tmp_path / "train.py"
    script.write_text(f"""import sys

from datasets import load_dataset
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

assert __name__ == "__main__"
args = SFTConfig(output_dir=sys.argv[1], per_device_train_batch_size=4, max_steps=3, max_length=256,
                 pad_to_multiple_of=64, bf16=False, report_to="none", use_cpu=True, save_strategy="no",
                 disable_tqdm=True)
SFTTrainer(model={str(TINY_MODEL)!r}, args=args, processing_class=AutoTokenizer.from_pretrained({str(TINY_MODEL)!r}),
           train_dataset=load_dataset("json", data_files={str(CAPYBARA)!r}, split="train")).train()
""", encoding="utf-8")
    result = shapeplan("guard", "--plan", plan_path, "--", "python", script, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    n = len(load_plan(plan_path).shapes)
    assert f"shapeplan: {n}/{n} planned shapes met, 0 unplanned, 0 compiles, counts as planned" in \
        result.stderr.splitlines()
