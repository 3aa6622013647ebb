"""`shapeplan analyze` through the command line: help, --json, -o, and one clear line for every bad input."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from shapeplan.cli import cli, main
from shapeplan.plan.io import load_plan, plan_to_dict
from shapeplan.services.analyze import analyze
from shapeplan.services.report import render_plan
from shapeplan.services.trainers import TRAINERS
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL, TLDR

MODEL = ["--model", str(TINY_MODEL)]
RUN = [str(TLDR), *MODEL, "--max_steps", "3", "--per_device_train_batch_size", "4"]
TRL_RUN = ["--dataset_name", str(TLDR), "--model_name_or_path", str(TINY_MODEL), "--max_steps", "3",
           "--per_device_train_batch_size", "4"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_help() -> None:
    runner = CliRunner()
    top = runner.invoke(cli, ["--help"])
    assert top.exit_code == 0 and "analyze" in top.stdout
    sub = runner.invoke(cli, ["analyze", "--help"])
    assert sub.exit_code == 0 and "DATASET" in sub.stdout and "--eval-dataset" in sub.stdout


def test_json_prints_the_plan_alone_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["analyze", *RUN, "--json"], capsys)
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data["schema"] == 1
    assert data == plan_to_dict(analyze("sft", TRL_RUN))


def test_output_writes_the_plan_and_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.json"
    code, out, err = _run(["analyze", *RUN, "-o", str(target)], capsys)
    plan = analyze("sft", TRL_RUN)
    assert (code, out, err) == (0, render_plan(plan) + "\n", f"plan written to {target}\n")
    assert load_plan(target) == plan


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bad inputs: data files and a copy of the tiny model whose tokenizer has no chat template."""
    root = tmp_path_factory.mktemp("bad")
    (root / "empty.jsonl").write_text("")
    (root / "garbage.jsonl").write_text("{not json\n")
    (root / "no-column.jsonl").write_text('{"foo": 1}\n')
    (root / "data.txt").write_text("hello\n")
    (root / "folder.jsonl").mkdir()
    shutil.copytree(TINY_MODEL, root / "no-template")
    (root / "no-template" / "chat_template.jinja").unlink()
    config = json.loads((root / "no-template" / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
    (root / "typo.yaml").write_text("max_lenght: 5\n")
    (root / "sampling.yaml").write_text("train_sampling_strategy: foo\n")  # YAML values skip argparse's choices
    return root


# (argv after `analyze`, with {bad} for the fixture folder) -> (exit code, start of the error line)
BAD_INPUTS = {
    "missing-dataset": (["{bad}/missing.jsonl", *MODEL], 1, "dataset {bad}/missing.jsonl not found"),
    "unsupported-file": (["{bad}/data.txt", *MODEL], 1, "dataset file {bad}/data.txt has an unsupported type"),
    "unreadable-dataset": (["{bad}/garbage.jsonl", *MODEL], 1, "cannot read dataset {bad}/garbage.jsonl: JSON parse"),
    "folder-without-data": (["{bad}/folder.jsonl", *MODEL], 1, "dataset {bad}/folder.jsonl not found"),
    "empty-dataset": (["{bad}/empty.jsonl", *MODEL], 1, "dataset {bad}/empty.jsonl is empty"),
    "no-usable-column": (["{bad}/no-column.jsonl", *MODEL], 1, "dataset has no usable column (it has foo)"),
    "no-chat-template": ([str(CAPYBARA), "--model", "{bad}/no-template"], 1,
                         "the dataset is conversational but the tokenizer has no chat template"),
    "missing-model": ([str(TLDR), "--model", "{bad}/no-model"], 1, "model folder {bad}/no-model not found"),
    "every-row-dropped": ([str(TLDR), *MODEL, "--max_length", "8"], 1, "every row of the train dataset was dropped"),
    "mistyped-option": ([str(TLDR), *MODEL, "--max_lenght", "5"], 2, "unknown option '--max_lenght'"),
    "mistyped-option-in-config": ([str(TLDR), *MODEL, "--config", "{bad}/typo.yaml"], 2,
                                  "unknown key 'max_lenght' in {bad}/typo.yaml: did you mean max_length?"),
    "bad-value": ([str(TLDR), *MODEL, "--max_length", "abc"], 2,
                  "argument --max_length/--max-length: invalid int value: 'abc'"),
    "bad-choice": ([str(TLDR), *MODEL, "--packing_strategy", "best"], 2,
                   "argument --packing_strategy/--packing-strategy: invalid choice: 'best'"),
    "missing-value": ([str(TLDR), *MODEL, "--max_length"], 2, "argument --max_length/--max-length: expected one"),
    "trl-config-error": ([str(TLDR), *MODEL, "--fp16", "--bf16", "true"], 2,
                         "invalid TRL option: At most one of fp16 and bf16"),
    "bad-launch-value": ([str(TLDR), *MODEL, "--num_processes", "two"], 2,
                         "argument --num_processes/--num-processes: invalid int value: 'two'"),
    "stray-argument": ([str(TLDR), *MODEL, "extra"], 2, "unexpected argument 'extra'"),
    "zero-batch-size": ([str(TLDR), *MODEL, "--per_device_train_batch_size", "0"], 2,
                        "--per_device_train_batch_size must be a positive integer"),
    "packing-without-max-length": ([str(TLDR), *MODEL, "--packing", "--max_length", "none"], 2,
                                   "packing needs max_length"),
    "eval-without-eval-data": ([str(TLDR), *MODEL, "--eval_strategy", "steps"], 1,
                               f"dataset {TLDR} has no split 'test' for the eval loop"),
    "both-model-spellings": ([str(TLDR), *MODEL, "--model_name_or_path", "x"], 2,
                             "both --model and --model_name_or_path are given"),
    "unknown-method": ([str(TLDR), "--method", "ppo"], 2, "Invalid value for '--method'"),
    "unwritable-output": ([*RUN, "-o", "{bad}/no-folder/plan.json"], 1,
                          "cannot write plan to {bad}/no-folder/plan.json"),
    "streaming-without-max-steps": ([str(TLDR), *MODEL, "--dataset_streaming"], 2,
                                    "a streamed dataset has no length, so the Trainer refuses it without max_steps"),
    "streaming-pass-shorter-than-ga": ([str(TLDR), *MODEL, "--dataset_streaming", "--max_steps", "100",
                                        "--gradient_accumulation_steps", "9"], 2,
                                       "the stream holds 8 batches per rank, fewer than gradient_accumulation_steps=9"),
    "unknown-sampling-in-config": ([str(TLDR), *MODEL, "--config", "{bad}/sampling.yaml"], 2,
                                   "train_sampling_strategy='foo' is not one shapeplan plans"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_an_exit_code(name: str, bad: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv, exit_code, message = BAD_INPUTS[name]
    code, out, err = _run(["analyze", *(a.format(bad=bad) for a in argv)], capsys)
    assert (code, out) == (exit_code, "")
    assert err.count("\n") == 1 and err.startswith("Error: " + message.format(bad=bad)), err


# (argv after the command) -> (exit code, start of the error line): refused from the words alone, before TRL,
# transformers, datasets or torch is imported
BEFORE_IMPORTS = {
    "hub-dataset-offline": (["trl-lib/Capybara", *MODEL], 1, "dataset trl-lib/Capybara is a Hub id, offline mode"),
    "hub-model-offline": ([str(TLDR), "--model", "Qwen/Qwen3-0.6B"], 1, "model Qwen/Qwen3-0.6B is a Hub id"),
    "missing-config": (["--config", "{tmp}/missing.yaml"], 2, "cannot read config file {tmp}/missing.yaml"),
    "missing-dataset": (["{tmp}/missing.jsonl", *MODEL], 1, "dataset {tmp}/missing.jsonl not found"),
    "missing-eval-dataset": ([str(TLDR), *MODEL, "--eval-dataset", "{tmp}/eval.jsonl"], 1,
                             "dataset {tmp}/eval.jsonl not found"),
    "own-short-option-after-dashes": (["--", "trl", "sft", "--dataset_name", str(TLDR), "--model_name_or_path",
                                       str(TINY_MODEL), "-o", "p.json"], 2,
                                      "-o is `shapeplan analyze`'s own option: give it before `--`"),
}


@pytest.mark.parametrize("name", sorted(BEFORE_IMPORTS))
def test_refusals_that_need_no_trl_come_before_importing_it(name: str, tmp_path: Path) -> None:
    from tests.adapters.test_plan_cache import PROBE

    argv, exit_code, message = BEFORE_IMPORTS[name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # an empty Hugging Face cache
    done = subprocess.run([sys.executable, "-c", PROBE, "analyze", *(a.format(tmp=tmp_path) for a in argv)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    error, probe = done.stderr.strip().splitlines()
    assert error.startswith("Error: " + message.format(tmp=tmp_path)), done.stderr
    assert json.loads(probe) == {"code": exit_code, "heavy": []}


def test_the_default_dataset_is_named_as_such_when_it_cannot_load(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache
    code, out, err = _run(["analyze", "--method", "grpo", *MODEL], capsys)
    assert (code, out, err.count("\n")) == (1, "", 1), err
    assert err.startswith("Error: dataset trl-lib/tldr is a Hub id") and \
        "(no dataset was given: trl-lib/tldr is `--method grpo`'s default" in err


@pytest.mark.parametrize("method", ["grpo", "distillation"])
def test_a_tool_calling_bound_without_tools_is_said_in_the_plan(method: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """No `trl` command passes tools, so the plan has no tool turn: a run given tools in Python would meet shapes
    the plan lacks, and the plan says so rather than stay silent."""
    extra = ["--teacher_model_name_or_path", str(TINY_MODEL)] if method == "distillation" else \
        ["--num_generations", "4"]
    argv = ["analyze", "--method", method, *RUN, *extra, "--json"]
    code, out, _ = _run([*argv, "--max_tool_calling_iterations", "2"], capsys)
    (warning,) = [w for w in json.loads(out)["warnings"] if "tool" in w]
    assert code == 0 and warning.startswith("max_tool_calling_iterations=2 is planned without tool calls: ")
    code, out, _ = _run(argv, capsys)  # unset: nothing to say
    assert code == 0 and not [w for w in json.loads(out)["warnings"] if "tool" in w]


def test_python_dash_m_reports_one_line_without_traceback() -> None:
    result = subprocess.run([sys.executable, "-m", "shapeplan", "analyze", str(TLDR), *MODEL, "--max_lenght", "5"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("Error: unknown option '--max_lenght'")


def _click_options(command: click.Command) -> set[str]:
    names = {opt for p in command.params if isinstance(p, click.Option) for opt in (*p.opts, *p.secondary_opts)}
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            names |= _click_options(sub)
    return names


def test_no_shapeplan_option_shadows_a_trl_or_accelerate_option() -> None:
    """shapeplan's own options sit among TRL's and `accelerate launch`'s; none may take one of theirs
    (-h/--help excepted: `shapeplan analyze --help` is shapeplan's help)."""
    from accelerate.commands.launch import launch_command_parser

    theirs = set(launch_command_parser()._option_string_actions)
    for spec in TRAINERS.values():
        theirs |= set(importlib.import_module(spec.script).make_parser()._option_string_actions)
    ours = _click_options(cli)
    assert {"--split", "--model", "--method", "--json", "-o", "--output", "--eval-dataset"} <= ours
    # but -q/--quiet: shapeplan's own before `--`, the launcher's after it (`-- accelerate launch -q trl ...`)
    assert ours & theirs == {"-q", "--quiet"}


def test_the_planning_core_imports_no_heavy_library() -> None:
    code = ("import pkgutil, importlib, sys, shapeplan.plan\n"
            "for m in pkgutil.iter_modules(shapeplan.plan.__path__):\n"
            "    importlib.import_module('shapeplan.plan.' + m.name)\n"
            "print(sorted(n for n in ('torch', 'trl', 'transformers', 'datasets', 'click', 'accelerate', 'numpy')"
            " if n in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "[]\n"), result.stderr


def test_no_cache_reads_a_file_rewritten_with_the_same_size_and_mtime(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """datasets keys its own Arrow cache of a local file by path, size and mtime; the rows must come from the
    file's content."""
    import os

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "x" * 600}) + "\n")
    stat = data.stat()
    argv = ["analyze", str(data), *MODEL, "--max_length", "1024", "--no-cache", "--json"]
    code, out, _ = _run(argv, capsys)
    before = json.loads(out)["stats"]["tokens"]
    data.write_text(json.dumps({"text": "hello world " * 50}) + "\n")  # as many bytes, fewer tokens
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert data.stat().st_size == stat.st_size and data.stat().st_mtime_ns == stat.st_mtime_ns
    code, out, _ = _run(argv, capsys)
    assert code == 0
    after = json.loads(out)["stats"]["tokens"]
    assert after < before
    code, out, _ = _run(["analyze", str(data), *MODEL, "--max_length", "1024", "--json"], capsys)
    assert json.loads(out)["stats"]["tokens"] == after  # the cached path sees the new rows too


def test_a_command_leaves_the_process_group_it_ran_in() -> None:
    """Under `accelerate launch` a rank's process group, left to the interpreter's teardown, now and then aborts the
    finished rank (gloo, exit -6): `main` tears it down before returning, whatever the command's outcome."""
    import torch.distributed as dist

    for argv in (["--version"], ["warm", "--plan", "/nonexistent/plan.json"]):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        main(argv)
        assert not dist.is_initialized()


def test_quiet_leaves_only_errors_and_warnings_on_stderr(tmp_path: Path) -> None:
    """`-q` on analyze and advise: no notes, no progress bars; the result on stdout is the same, and an error is
    still its one line (warm and verify: tests/warm/test_cli.py)."""
    from tests import console

    run = [str(CAPYBARA), "--model", str(TINY_MODEL), "--max_length", "512"]
    loud = console.run(["analyze", *run, "-o", tmp_path / "a.json"])
    assert loud.returncode == 0 and f"plan written to {tmp_path / 'a.json'}" in loud.stderr, loud.stderr
    quiet = console.run(["analyze", "-q", *run, "-o", tmp_path / "b.json"])
    assert (quiet.returncode, quiet.stderr, quiet.stdout) == (0, "", loud.stdout)
    advice = console.run(["advise", "--quiet", *run, "--html", tmp_path / "advice.html"])
    assert (advice.returncode, advice.stderr) == (0, "") and "recommendation" in advice.stdout
    assert (tmp_path / "advice.html").is_file()
    refused = console.run(["analyze", "-q", *run, "--max_length", "-1"])
    assert refused.returncode == 2 and refused.stderr.startswith("Error: ") and refused.stderr.count("\n") == 1


def test_a_misspelt_option_or_config_key_names_the_nearest_and_where_it_was(tmp_path: Path) -> None:
    """The hint looks at shapeplan's own options first (`--modle` is `--model`, not accelerate's `--module`); a
    misspelt key of a --config file is named as the key, with its file."""
    from tests import console

    typo = console.run(["analyze", CAPYBARA, "--modle", TINY_MODEL])
    assert typo.returncode == 2
    assert typo.stderr == ("Error: unknown option '--modle': did you mean --model, `shapeplan analyze`'s own option? "
                           "see `shapeplan analyze --help`\n")
    trl = console.run(["analyze", CAPYBARA, "--model", TINY_MODEL, "--per_devce_train_batch_size", "4"])
    assert trl.returncode == 2 and "did you mean --per_device_train_batch_size?" in trl.stderr, trl.stderr
    config = tmp_path / "sft.yaml"
    config.write_text("max_length: 512\nper_devce_train_batch_size: 4\n", encoding="utf-8")
    key = console.run(["analyze", CAPYBARA, "--model", TINY_MODEL, "--config", config])
    assert key.returncode == 2 and key.stderr.count("\n") == 1, key.stderr
    assert key.stderr.startswith(f"Error: unknown key 'per_devce_train_batch_size' in {config}: did you mean "
                                 "per_device_train_batch_size? "), key.stderr


# Pages still citing tests or source lines, edited by others at the time of writing; neuron.md's table cites
# TorchNeuron's own source, which is what it documents.
_DOCS_CITING = {"neuron.md"}


def test_user_docs_cite_no_test_files_or_trl_lines() -> None:
    """The user-facing pages say what was checked, not in which test file, and name TRL's functions, not its line
    numbers (`grpo_trainer.py:2200`), which move with every release; docs/development.md says where."""
    import re

    citation = re.compile(r"tests/|\btest_\w+\.py|\b(?!train\.py)\w+\.py:\d+")  # `train.py:42` is the user's script
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name in {"development.md", "architecture.md", *_DOCS_CITING}:
            continue
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            found += [f"{page.name}:{number}: {m.group(0)}" for m in citation.finditer(line)]
    assert found == []
