"""Every row of the README's exit-code table, through the installed `shapeplan` console script in a subprocess (the
entry point a pipeline runs): the code, and for an error its one line on stderr, nothing on stdout, no traceback.

Also what `verify` promises a baked image: it leaves the cache dir exactly as it found it (file list, checksums,
modes and the folders' modification times, which any file created in them, even one deleted again, changes), works
on a read-only cache dir, and a second `verify` of an unwarmed cache still fails. And the guide's GRPO example, which
`analyze` plans with no TRL option, warms with its one reward function.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shapeplan.cache.archive import ARCHIVE_META
from shapeplan.plan.io import write_plan
from shapeplan.plan.vision import FAMILIES
from tests import console
from tests.cache.test_archive import _rewrite, _warmed_cache
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL, TLDR, WarmedSFT
from tests.warm.harness import LORA, plan_for

SHAPEPLAN = console.SHAPEPLAN
EAGER = ["--max_length", "128", "--per_device_train_batch_size", "2", "--max_steps", "1"]


def shapeplan(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return console.run(args)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Error" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stdout


def refused(result: subprocess.CompletedProcess[str], code: int, message: str) -> None:
    assert (result.returncode, result.stdout) == (code, ""), result.stderr[-3000:]
    assert result.stderr.splitlines() == [f"Error: {message}"]


@pytest.fixture
def eager_plan(tmp_path: Path) -> Path:
    """An SFT plan of one eager train shape: warming it builds the real trainer and runs one step."""
    path = tmp_path / "plan.json"
    write_plan(plan_for("sft", CAPYBARA, EAGER, tmp_path / "out"), path)
    return path


# -- analyze ---------------------------------------------------------------------------------------------------


def test_analyze(tmp_path: Path) -> None:
    assert "SFT plan" in ok(shapeplan("analyze", CAPYBARA, "--model", TINY_MODEL, "-o", tmp_path / "plan.json"))
    assert (tmp_path / "plan.json").is_file()
    missing = tmp_path / "missing.jsonl"
    refused(shapeplan("analyze", missing, "--model", TINY_MODEL), 1,
            f"dataset {missing} not found: no such file or folder; pass an existing path or a Hub dataset id")
    refused(shapeplan("analyze", CAPYBARA, "--model", TINY_MODEL, "--max_lenght", "5"), 2,
            "unknown option '--max_lenght': did you mean --max_length? it is neither a TRL `sft` option nor an "
            "`accelerate launch` option; "
            "see `trl sft --help`")


def test_analyze_streaming(tmp_path: Path) -> None:
    """Streaming SFT and Reward runs are planned; what the Trainer or TRL refuse on a stream, and what is not planned,
    exit 2."""
    out = ok(shapeplan("analyze", CAPYBARA, "--model", TINY_MODEL, "--dataset_streaming", "--max_steps", "2"))
    assert "warning: streaming: the run reads the first 16 prepared train rows (16 source rows read" in out
    refused(shapeplan("analyze", CAPYBARA, "--model", TINY_MODEL, "--dataset_streaming"), 2,
            "a streamed dataset has no length, so the Trainer refuses it without max_steps; pass --max_steps N")
    # 96 rows in batches of 8: 12 micro-batches per pass, each pass reshuffled
    out = ok(shapeplan("analyze", CAPYBARA, "--model", TINY_MODEL, "--dataset_streaming", "--max_steps", "20",
                       "--shuffle_dataset"))
    assert "the whole stream 2 times, each pass in its own order" in out
    refused(shapeplan("analyze", CAPYBARA, "--model", TINY_MODEL, "--dataset_streaming", "--max_steps", "20",
                      "--shuffle_dataset", "--gradient_accumulation_steps", "16"), 2,
            "the stream holds 12 batches per rank, fewer than gradient_accumulation_steps=16: the Trainer never "
            "completes an optimizer step and reads it again without end; stream more data or lower "
            "--gradient_accumulation_steps")
    preference = ROOT / "tests" / "fixtures" / "preference-explicit.jsonl"
    refused(shapeplan("analyze", "--method", "dpo", preference, "--model", TINY_MODEL, "--dataset_streaming",
                      "--max_steps", "2", "--precompute_ref_log_probs"), 2,
            "TRL's dpo trainer refuses precompute_ref_log_probs=True on a streamed dataset (an IterableDataset); "
            "drop --precompute_ref_log_probs or --dataset_streaming")
    out = ok(shapeplan("analyze", "--method", "reward", preference, "--model", TINY_MODEL, "--dataset_streaming",
                       "--max_steps", "2"))
    # 17: TRL's preparation reads the first row once more to see its format
    assert "warning: streaming: the run reads the first 16 prepared train rows (17 source rows read" in out
    refused(shapeplan("analyze", "--method", "kto", ROOT / "tests" / "fixtures" / "kto-unpaired.jsonl", "--model",
                      TINY_MODEL, "--dataset_streaming"), 2,
            "a streamed dataset has no length, so the Trainer refuses it without max_steps; pass --max_steps N")


def test_analyze_refuses_vision_language_data(tmp_path: Path) -> None:
    """An image column makes TRL feed the rows through a processor (image tokens, pixel batches): the methods that do
    not plan them refuse it, instead of planning the text; SFT and GRPO refuse what they do not plan (a text model;
    for SFT, images only in the eval set)."""
    rows = {"sft": {"messages": [{"role": "user", "content": "what is shown"},
                                 {"role": "assistant", "content": "a cat"}]},
            "dpo": {"prompt": "what is shown", "chosen": "a cat", "rejected": "a dog"},
            "grpo": {"prompt": "what is shown"}}
    for method, row in rows.items():
        data = tmp_path / f"{method}.jsonl"
        data.write_text(json.dumps({**row, "images": ["cat.png"]}) + "\n")
        message = (f"dataset {data} has an 'images' column: vision-language {method} runs are not planned yet (their "
                   "image tokens and pixel batches are not counted); shapeplan plans images for SFT, GRPO and RLOO "
                   "runs, and text-only datasets for the other methods")
        if method == "dpo":
            refused(shapeplan("analyze", "--method", method, data, "--model", TINY_MODEL, "--no-cache"), 2, message)
            continue
        refused(shapeplan("analyze", "--method", method, data, "--model", TINY_MODEL, "--no-cache"), 2,
                "the dataset has images, and " + str(TINY_MODEL) + " is a 'qwen3' model, whose processor shapeplan "
                f"does not plan images for (it plans {', '.join(FAMILIES)}); plan one of those, or drop the image "
                "columns")
        if method != "sft":
            continue
        refused(shapeplan("analyze", CAPYBARA, "--model", TINY_MODEL, "--no-cache", "--eval-dataset", data,
                          "--eval_strategy", "steps"), 2, "the eval dataset has images and the train dataset has none: "
                "SFTTrainer picks its collator from the train rows, so the eval images are not fed to the model; drop "
                "the eval set's image columns or train on images too")


# -- warm ------------------------------------------------------------------------------------------------------


def test_warm(tmp_path: Path, eager_plan: Path) -> None:
    cache = tmp_path / "cache"
    assert "1 eager" in ok(shapeplan("warm", "--plan", eager_plan, "--device", "cpu", "--cache-dir", cache))
    # again: every shape is in the manifest
    assert "1 skipped" in ok(shapeplan("warm", "--plan", eager_plan, "--device", "cpu", "--cache-dir", cache))

    blocker = tmp_path / "file"
    blocker.write_text("")
    refused(shapeplan("warm", "--plan", eager_plan, "--device", "cpu", "--cache-dir", blocker / "cache"), 1,
            f"cache dir {blocker / 'cache'} is not writable (Not a directory); pass a writable folder with "
            "--cache-dir")
    missing = tmp_path / "missing.json"
    refused(shapeplan("warm", "--plan", missing, "--device", "cpu", "--cache-dir", cache), 1,
            f"cannot read plan {missing}: No such file or directory; pass a file written by `shapeplan analyze -o`")
    refused(shapeplan("warm", "--plan", eager_plan, "--device", "tpu"), 2,
            "Invalid value for '--device': 'tpu' is not one of 'neuron', 'cuda', 'cpu'; see `shapeplan warm --help`")


def test_warm_streaming_run(tmp_path: Path) -> None:
    """Plan and warm a streaming run in one go: the warm-up builds the run's trainer and runs its planned shape."""
    out = ok(shapeplan("warm", CAPYBARA, "--model", TINY_MODEL, "--dataset_streaming", *EAGER, "--device", "cpu",
                       "--cache-dir", tmp_path / "cache"))
    assert "1 eager" in out


def test_warm_of_a_model_whose_weights_cannot_load_exits_1(tmp_path: Path) -> None:
    """A model whose weights file is not safetensors: refused before any shape, in one line naming the file."""
    model = tmp_path / "model"
    model.mkdir()
    for item in TINY_MODEL.iterdir():
        (model / item.name).write_bytes(item.read_bytes())
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    plan = tmp_path / "plan.json"
    write_plan(plan_for("sft", CAPYBARA, [*EAGER, "--model_name_or_path", str(model)], tmp_path / "out"), plan)
    result = shapeplan("warm", "--plan", plan, "--device", "cpu", "--cache-dir", tmp_path / "cache", "--json")
    refused(result, 1, f"model file {model / 'model.safetensors'} is truncated or not safetensors; download the "
            "model again or pass another folder with --model")
    assert not (tmp_path / "cache").exists()


def test_warm_refuses_a_run_without_a_reward_up_front(tmp_path: Path) -> None:
    """Refused once, before planning (RLOO's defaults need more prompts than one: planning would fail first) and
    before any model loads."""
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(TLDR.read_text().splitlines()[0] + "\n")
    refused(shapeplan("warm", "--method", "rloo", prompts, "--model", TINY_MODEL, "--device", "cpu",
                      "--cache-dir", tmp_path / "cache"), 2,
            "the run has no reward function; pass --reward_funcs as for `trl grpo` / `trl rloo`")


@pytest.mark.slow
def test_warm_plans_and_warms_the_guide_grpo_example(tmp_path: Path) -> None:
    """No TRL option: `warm` warms what `analyze` plans, the guide's example with its one reward function."""
    prompts = tmp_path / "prompts.jsonl"
    shortest = min(TLDR.read_text().splitlines(), key=lambda row: len(json.loads(row)["prompt"]))
    prompts.write_text(shortest + "\n")  # one prompt: one generate size
    planned = json.loads(ok(shapeplan("analyze", "--method", "grpo", prompts, "--model", TINY_MODEL, "--json")))
    assert "Trainium guide GRPO example" in planned["warnings"][0]
    result = shapeplan("warm", "--method", "grpo", prompts, "--model", TINY_MODEL, "--device", "cpu",
                       "--cache-dir", tmp_path / "cache", "--json")
    report = json.loads(ok(result))
    # the warnings analyze gives come first, and every generate task's row is its own
    assert f"warning: {planned['warnings'][0]}" in result.stderr.splitlines()
    labels = [m.group(1) for line in result.stderr.splitlines()
              if (m := re.match(r"(?:\[[^]]*\] )?eager +(.+?) +[\d.]+s", line))]  # a log row leads with [k/N, ...]
    assert len(labels) == len(report["results"]) == len(set(labels))
    generate = [s for s in planned["shapes"] if s["phase"] == "generate"]
    assert [(r["phase"], r["batch"], r["seq"]) for r in report["results"]] == [
        ("generate", s["batch"], s["seq"]) for s in generate]
    assert {r["status"] for r in report["results"]} == {"eager"}  # eager on CPU: run, nothing to compile
    assert report["environment"]["dtype"]["bf16"] is True  # the guide's bf16, not TRL's default


@pytest.mark.slow
def test_warm_warms_every_planned_shape_of_a_run_with_a_reward_model(tmp_path: Path) -> None:
    """A reward model's inputs are re-tokenized text, a length the plan cannot know: `analyze` plans the rest and says
    so, and `warm` warms all of that rest, a stand-in scoring for the reward model, and says so too."""
    prompts = tmp_path / "prompts.jsonl"
    shortest = min(TLDR.read_text().splitlines(), key=lambda row: len(json.loads(row)["prompt"]))
    prompts.write_text(shortest + "\n")
    argv = ["--method", "grpo", prompts, "--model", TINY_MODEL, "--reward_model_name_or_path", "my-org/reward",
            "--reward_funcs", "accuracy_reward"]
    planned = json.loads(ok(shapeplan("analyze", *argv, "--json")))
    assert any(w.startswith("reward model my-org/reward is not planned") for w in planned["warnings"])
    report = json.loads(ok(shapeplan("warm", *argv, "--device", "cpu", "--cache-dir", tmp_path / "cache", "--json")))
    # a warm task is a generate size, whose round runs the train shapes its completions make
    assert sorted((r["phase"], r["batch"], r["seq"]) for r in report["results"]) == sorted(
        (s["phase"], s["batch"], s["seq"]) for s in planned["shapes"] if s["phase"] == "generate")
    assert {r["status"] for r in report["results"]} == {"eager"}
    assert "reward model my-org/reward is not warmed (its shapes are not planned): a stand-in scores the " \
           "completions" in report["warnings"]


# -- verify ----------------------------------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under `folder` (itself included): kind, mode, modification time, and a file's sha256."""
    out: dict[str, tuple[object, ...]] = {}
    for path in sorted([folder, *folder.rglob("*")]):
        info = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        out[path.relative_to(folder).as_posix()] = (stat.S_IFMT(info.st_mode), info.st_mode, info.st_mtime_ns, digest)
    return out


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[list[Path]]:
    """Folders made read-only (chmod -R a-w) for a test; writable again afterwards so they can be deleted."""
    folders: list[Path] = []
    yield folders
    for folder in folders:
        for path in [folder, *folder.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)


def make_read_only(folder: Path, registry: list[Path]) -> None:
    registry.append(folder)
    for path in sorted([folder, *folder.rglob("*")], reverse=True):  # children first
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def test_verify(tmp_path: Path, eager_plan: Path, read_only: list[Path]) -> None:
    # A warmed-looking cache, read-only. Tests may run as root, whom modes do not stop: the snapshot's folder
    # modification times show any file created (even deleted again) inside.
    cache = _warmed_cache(tmp_path / "cache")
    (cache / "locks").mkdir()
    (cache / "locks" / "graph.lock").write_text("")
    make_read_only(cache, read_only)
    before = snapshot(cache)
    # eager CPU compiles nothing, so verify proves nothing: it says so, and exits 0 (every shape ran)
    assert "verify: nothing to compile" in ok(shapeplan("verify", "--plan", eager_plan, "--device", "cpu",
                                                        "--cache-dir", cache))
    assert snapshot(cache) == before
    assert not list(tmp_path.glob(".shapeplan-verify-*"))  # the scratch view is gone

    missing = tmp_path / "missing"
    refused(shapeplan("verify", "--plan", eager_plan, "--device", "cpu", "--cache-dir", missing), 1,
            f"cache dir {missing} does not exist; warm it with `shapeplan warm --cache-dir {missing}` first, or "
            "pass the warmed folder with --cache-dir")
    assert not missing.exists()
    refused(shapeplan("verify", "--device", "cpu"), 2, "Missing option '--plan'; see `shapeplan verify --help`")


@pytest.mark.slow
def test_verify_and_import_refuse_a_cache_warmed_with_other_peft_settings(tmp_path: Path) -> None:
    cache, plans = tmp_path / "cache", {}
    for name, peft in {"lora": LORA, "none": [], "rank-4": [*LORA, "--lora_r", "4"]}.items():
        plans[name] = tmp_path / f"{name}.json"
        write_plan(plan_for("sft", CAPYBARA, [*EAGER, *peft], tmp_path / "out"), plans[name])
    ok(shapeplan("warm", "--plan", plans["lora"], "--device", "cpu", "--cache-dir", cache))
    lora = "LoRA r=8, alpha=16, dropout=0.05, targets=all-linear"
    refused(shapeplan("verify", "--plan", plans["none"], "--device", "cpu", "--cache-dir", cache), 3,
            f"the cache dir was warmed for {lora}, this run trains no PEFT (full fine-tuning): other graphs; warm it "
            "with the run's PEFT options (`shapeplan warm --plan PLAN`)")
    refused(shapeplan("verify", "--plan", plans["rank-4"], "--device", "cpu", "--cache-dir", cache), 3,
            f"the cache dir was warmed for {lora}, this run trains {lora.replace('r=8', 'r=4')}: other graphs; "
            "warm it with the run's PEFT options (`shapeplan warm --plan PLAN`)")
    assert "verify: nothing to compile" in ok(shapeplan("verify", "--plan", plans["lora"], "--device", "cpu",
                                                        "--cache-dir", cache))  # eager CPU: every shape ran
    # cache import --plan: the archive of that cache is refused for the full fine-tune, imported for the LoRA run
    archive = tmp_path / "cache.tar.gz"
    ok(shapeplan("cache", "export", "--cache-dir", cache, "-o", archive))
    refused(shapeplan("cache", "import", archive, "--cache-dir", tmp_path / "none", "--plan", plans["none"]), 3,
            f"{archive} was warmed for {lora}, this run trains no PEFT (full fine-tuning): other graphs; warm it "
            "with the run's PEFT options (`shapeplan warm --plan PLAN`)")
    assert not (tmp_path / "none").exists()
    ok(shapeplan("cache", "import", archive, "--cache-dir", tmp_path / "lora", "--plan", plans["lora"]))


@pytest.mark.slow
def test_verify_never_writes_the_cache_it_checks(warmed_sft: WarmedSFT, tmp_path: Path,
                                                 read_only: list[Path]) -> None:
    """torch.compile on Inductor: verify on an unwarmed cache fails, leaving it unchanged (its compiles did not
    land in the cache); once warmed (with the session's warm-up of the same plan) and made read-only, verify passes
    and changes nothing."""
    plan = warmed_sft.plan
    cache = tmp_path / "cache"  # Inductor's C++ builds fail under a path with a space
    cache.mkdir()
    (cache / "unrelated.txt").write_text("kept as it is")
    before = snapshot(cache)
    result = shapeplan("verify", "--plan", plan, "--device", "cpu", "--cache-dir", cache, "--json")
    assert result.returncode == 1, result.stderr[-3000:]
    (row,) = json.loads(result.stdout)["results"]
    assert row["status"] == "compiled" and row["counters"]["fxgraph_cache_miss"] > 0
    assert snapshot(cache) == before

    warmed = warmed_sft.report
    assert [r["status"] for r in warmed["results"]] == ["compiled"]
    # what a Packer/systemd step sources is what --json reports
    assert warmed["environment_variables"] == {
        "TORCHINDUCTOR_CACHE_DIR": str(warmed_sft.cache), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1", "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
        "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES": "0"}
    sourced = subprocess.run(["bash", "-c", 'set -e; . "$0"; echo "$TORCHINDUCTOR_CACHE_DIR"', warmed_sft.env_file],
                             capture_output=True, text=True, check=True)
    assert sourced.stdout == f"{warmed_sft.cache}\n"
    shutil.copytree(warmed_sft.cache, cache, dirs_exist_ok=True)  # as `cache import` would bring it here
    make_read_only(cache, read_only)
    before = snapshot(cache)
    (row,) = json.loads(ok(shapeplan("verify", "--plan", plan, "--device", "cpu", "--cache-dir", cache,
                                     "--json")))["results"]
    assert row["status"] == "cached" and row["counters"]["fxgraph_cache_hit"] > 0
    assert snapshot(cache) == before


# -- cache export / import / inspect ---------------------------------------------------------------------------


def test_cache_export(tmp_path: Path) -> None:
    archive = tmp_path / "cache.tar.gz"
    assert "exported 1 warmed shape(s)" in ok(shapeplan("cache", "export", "--cache-dir",
                                                        _warmed_cache(tmp_path / "cache"), "-o", archive))
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(shapeplan("cache", "export", "--cache-dir", empty, "-o", tmp_path / "b.tar.gz"), 1,
            f"{empty} has no shapeplan-manifest.json; warm it with `shapeplan warm --cache-dir {empty}` first")
    refused(shapeplan("cache", "export", "--cache-dir", empty), 2,
            "Missing option '-o' / '--output'; see `shapeplan cache export --help`")


def test_cache_import_and_inspect(tmp_path: Path) -> None:
    archive = tmp_path / "cache.tar.gz"
    ok(shapeplan("cache", "export", "--cache-dir", _warmed_cache(tmp_path / "cache"), "-o", archive))
    assert "imported 1 warmed shape(s)" in ok(shapeplan("cache", "import", archive, "--cache-dir",
                                                        tmp_path / "imported"))
    missing = tmp_path / "missing.tar.gz"
    refused(shapeplan("cache", "import", missing, "--cache-dir", tmp_path / "t"), 1,
            f"archive {missing} does not exist; pass a file written by `shapeplan cache export`")
    refused(shapeplan("cache", "import", "--bogus", archive), 2,
            "No such option '--bogus'; see `shapeplan cache import --help`")
    with tarfile.open(archive, "r:gz") as tar:
        meta = json.loads(tar.extractfile(ARCHIVE_META).read())  # type: ignore[union-attr]  # a file member
    here = meta["environment"]["versions"]["trl"]
    meta["environment"]["versions"]["trl"] = "1.15.0"
    other = _rewrite(archive, tmp_path / "other.tar.gz", meta=meta)
    refused(shapeplan("cache", "import", other, "--cache-dir", tmp_path / "t"), 3,
            f"{other} was compiled for another environment: trl=1.15.0 (this machine: {here}); warm this machine's "
            "own cache with `shapeplan warm` instead")
    assert not (tmp_path / "t").exists()

    assert f"{archive}  (3 file(s)" in ok(shapeplan("cache", "inspect", archive))
    refused(shapeplan("cache", "inspect", CAPYBARA), 1,
            f"{CAPYBARA} is not a shapeplan cache archive (not a gzip file); pass a file written by "
            "`shapeplan cache export`")
    refused(shapeplan("cache", "inspect"), 2, "Missing argument 'ARCHIVE'; see `shapeplan cache inspect --help`")
    refused(shapeplan("cache", "inspect", tmp_path), 2, f"{tmp_path} is a folder, not an archive; `shapeplan cache "
            f"ls --cache-dir {tmp_path}` lists what a cache dir holds")
