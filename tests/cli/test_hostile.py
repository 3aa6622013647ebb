"""Hostile input through the installed console script: every bad input of issues 12, 22 and 53 gives one line on stderr,
its documented exit code (README), and writes nothing (no plan, cache dir, archive or temporary file); runs that
would take unbounded work are refused in seconds (benchmarks/bounded_work.py times them)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from shapeplan.plan.io import load_plan
from tests import console
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL


def _plan(**shape: Any) -> dict[str, Any]:
    """A valid SFT plan for the tiny model, its one shape updated with `shape`."""
    return {"schema": 1, "method": "sft", "exact": True, "pad_to_multiple_of": 128, "versions": {},
            "config": {"argv": ["--model_name_or_path", str(TINY_MODEL), "--dataset_name", str(CAPYBARA)]},
            "fingerprint": {}, "stats": {"rows": 2, "dropped_rows": 0, "micro_batches": 1, "optimizer_steps": 1,
                                         "tokens": 200, "padded_tokens": 256},
            "shapes": [{"phase": "train", "batch": 2, "seq": 128, "count": 1, "first_step": 1, **shape}],
            "warnings": []}


def _text(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


SHAPE = b'{"phase": "train", "batch": 2, "seq": 128, "count": 1, "first_step": 1}'
PLANS: dict[str, bytes] = {
    "seq 10^9": _text(_plan(seq=10 ** 9 // 128 * 128)),
    "seq 1e308": _text(_plan(seq=1e308)),
    "seq 5000 digits": _text(_plan()).replace(b'"seq": 128', b'"seq": ' + b"9" * 5000),
    "batch 1e30": _text(_plan(batch=1e30)),
    "seq Infinity": _text(_plan()).replace(b'"seq": 128', b'"seq": Infinity'),
    "batch -4": _text(_plan(batch=-4)),
    "batch 0": _text(_plan(batch=0)),
    "seq 200, pad 128": _text(_plan(seq=200)),
    "seq 0": _text(_plan(seq=0)),
    "seq -128": _text(_plan(seq=-128)),
    "count 0": _text(_plan(count=0)),
    "batch a string": _text(_plan(batch="2")),
    "unknown phase": _text(_plan(phase="training")),
    "duplicate shapes": _text(_plan()).replace(SHAPE, SHAPE + b", " + SHAPE),
    "no shapes": _text({**_plan(), "shapes": []}),
    "duplicate key": _text(_plan()).replace(b'"seq": 128', b'"seq": 128, "seq": 256'),
    "non-UTF-8": _text(_plan()).replace(b'"warnings": []', b'"warnings": ["\xff\xfe"]'),
    "unknown method": _text({**_plan(), "method": "ppo"}),
    "seq over max_position_embeddings": _text(_plan(seq=8192)),
    "no config": _text({k: v for k, v in _plan().items() if k != "config"}),
    "argv a string": _text({**_plan(), "config": {"argv": "--max_length 128"}}),
    "negative batch size in config": _text({**_plan(), "config": {**_plan()["config"],
                                                                  "per_device_train_batch_size": -4}}),
    "a list for a batch size in config": _text({**_plan(), "config": {**_plan()["config"],
                                                                      "per_device_train_batch_size": [2]}}),
    "shape without seq": _text({**_plan(), "shapes": [{"phase": "train", "batch": 2, "count": 1,
                                                        "first_step": 1}]}),
    "nested 100000 deep": _text(_plan()).replace(b'"warnings": []', b'"warnings": ' + b"[" * 100_000 + b"]" * 100_000),
    "no schema": _text({k: v for k, v in _plan().items() if k != "schema"}),
    "cache_len below the prompt": _text(_plan(cache_len=64)),
    "pad_tool_turns a string": _text({**_plan(), "config": {**_plan()["config"], "pad_tool_turns": "yes"}}),
    "pin_cache of no length": _text({**_plan(), "config": {**_plan()["config"], "pin_cache": 0}}),
    "negative tool iterations in the recorded argv": _text(
        {**_plan(), "method": "grpo", "config": {"argv": [*_plan()["config"]["argv"], "--reward_funcs",
                                                          "accuracy_reward", "--max_tool_calling_iterations", "-1"]}}),
}
# What the line names of a plan that lost or mangled a field: its schema path.
PLAN_FIELDS = {"no config": "config is missing", "shape without seq": "shapes[0].seq is missing",
               "no schema": "schema is missing", "cache_len below the prompt": "shapes[0].cache_len is 64, below",
               "pad_tool_turns a string": "config.pad_tool_turns must be a bool",
               "pin_cache of no length": "config.pin_cache must be a cache length from 1",
               "negative tool iterations in the recorded argv": "--max_tool_calling_iterations must be 0 or more"}


SHAPEPLAN = console.SHAPEPLAN


def _console(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return console.run(args, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=300)


def _files(folder: Path) -> dict[str, bytes]:
    """Everything under `folder` but `inductor/`: conftest points torch's own cache there, which torch creates
    when it is imported (analyze imports it through TRL)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(folder.rglob("*")) if p.relative_to(folder).parts[0] != "inductor"}


def _one_line(args: list[str], cwd: Path, code: int, **env: str) -> str:
    """Run `args`: exit `code`, one line on stderr, nothing written under `cwd`."""
    before = _files(cwd)
    done = _console(args, cwd, **env)
    assert done.returncode == code, done.stderr[-2000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith("Error: ") and "Traceback" not in line
    assert _files(cwd) == before
    return line


def test_the_valid_base_plan_loads(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_bytes(_text(_plan()))
    assert load_plan(tmp_path / "plan.json").shapes[0].seq == 128


@pytest.mark.parametrize("case", list(PLANS))
def test_bad_plan_is_one_line_exit_1_and_creates_no_cache_dir(case: str, tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_bytes(PLANS[case])
    line = _one_line(["warm", "--plan", "plan.json", "--device", "cpu", "--cache-dir", "cache"], tmp_path, 1)
    assert "plan" in line and "re-create" in line and PLAN_FIELDS.get(case, "") in line
    assert not (tmp_path / "shapeplan").exists()  # $SHAPEPLAN_CACHE_DIR


MANIFESTS = {"not UTF-8": b'{"schema": 1, "environments": {"\xff": 1}}', "bad JSON": b'{"schema": 1, "envir',
             "wrong structure": b'{"schema": 1, "environments": {"k": {"environment": [], "shapes": 3}}}',
             "a list": b"[1, 2]"}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_bad_manifest_on_export_is_one_line(case: str, tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "shapeplan-manifest.json").write_bytes(MANIFESTS[case])
    line = _one_line(["cache", "export", "--cache-dir", "cache", "-o", "out.tar.gz"], tmp_path, 1)
    assert "manifest" in line and "delete it to re-warm" in line


def _archive(path: Path, environment: Any) -> Path:
    meta = json.dumps({"schema": 2, "environment": environment, "files": {}, "expanded": 0}).encode()
    with tarfile.open(path, "w:gz") as tar:
        entry = tarfile.TarInfo("shapeplan-archive.json")
        entry.size = len(meta)
        tar.addfile(entry, io.BytesIO(meta))
    return path


@pytest.mark.parametrize("environment", [[], {"versions": {}, "compiler": "O2"}, {"versions": "x", "compiler": {}}])
def test_archive_of_the_wrong_structure_is_one_line(environment: Any, tmp_path: Path) -> None:
    _archive(tmp_path / "a.tar.gz", environment)
    assert "malformed shapeplan-archive.json" in _one_line(
        ["cache", "import", "a.tar.gz", "--cache-dir", "target"], tmp_path, 1)
    assert "malformed" in _one_line(["cache", "inspect", "a.tar.gz"], tmp_path, 1)


def test_unwritable_export_output_and_import_target(tmp_path: Path) -> None:
    """/proc takes no new files, even from root."""
    from tests.cache.test_archive import _warmed_cache

    _warmed_cache(tmp_path / "cache")
    assert _one_line(["cache", "export", "--cache-dir", "cache", "-o", "/proc/shapeplan.tar.gz"], tmp_path, 1) \
        .startswith("Error: cannot write /proc/shapeplan.tar.gz: ")
    assert _console(["cache", "export", "--cache-dir", "cache", "-o", "a.tar.gz"], tmp_path).returncode == 0
    assert _one_line(["cache", "import", "a.tar.gz", "--cache-dir", "/proc/shapeplan-cache"], tmp_path, 1) \
        .startswith("Error: cannot create /proc/shapeplan-cache (")


@pytest.mark.parametrize("option", [["--num_processes", "0"], ["--max_length", "-1"], ["--num_train_epochs", "-1"]])
def test_bad_analyze_option_is_a_usage_error(option: list[str], tmp_path: Path) -> None:
    line = _one_line(["analyze", str(CAPYBARA), "--model", str(TINY_MODEL), *option, "-o", "plan.json"], tmp_path, 2)
    assert option[0] in line


# -- issue 22 ----------------------------------------------------------------------------------------------------

ANALYZE = ["analyze", str(CAPYBARA), "--model", str(TINY_MODEL), "--no-cache"]


@pytest.mark.parametrize("value", ["abc", "0", "-3", "100000"])
def test_bad_worker_setting_is_refused_before_anything_forks(value: str, tmp_path: Path) -> None:
    line = _one_line([*ANALYZE, "-o", "plan.json"], tmp_path, 2, SHAPEPLAN_WORKERS=value)
    assert "SHAPEPLAN_WORKERS" in line and repr(value) in line


@pytest.mark.parametrize("args", [
    ["analyze", "--generate-compile-minutes", "nan"], ["warm", "--worker-memory-gib", "nan"],
    ["warm", "--worker-memory-gib", "inf"], ["cache", "import", "a.tar.gz", "--cache-dir", "c", "--max-gib", "nan"],
    ["cache", "merge", "a.tar.gz", "-o", "b.tar.gz", "--max-metadata-mib", "inf"],
])
def test_non_finite_float_option_is_a_usage_error(args: list[str], tmp_path: Path) -> None:
    line = _one_line(args, tmp_path, 2)
    assert args[-2] in line and "not a finite number" in line


# Each answered in seconds: refused before the plan walks (or deals) what the number asks for.
UNBOUNDED = {
    "max_steps 1e9": (["--max_steps", "1000000000"], "--max_steps 1000000000"),
    "epochs 1e9": (["--num_train_epochs", "1000000000"], "--num_train_epochs 1e+09"),
    "100000 ranks": (["--num_processes", "100000"], "--num_processes 100000"),
    "1000 ranks, 1000 steps": (["--num_processes", "1000", "--max_steps", "1000"], "--num_processes 1000"),
    "dataset_num_proc 100000": (["--dataset_num_proc", "100000"], "--dataset_num_proc"),
    "pad_to_multiple_of 1e12": (["--pad_to_multiple_of", "1000000000000"], "--pad_to_multiple_of"),
    "epochs nan": (["--num_train_epochs", "nan"], "--num_train_epochs must be a finite number"),
    "epochs inf": (["--num_train_epochs", "inf"], "--num_train_epochs must be a finite number"),
    "seed 2**70": (["--seed", str(2 ** 70)], "--seed must be from 0"),
    "pad abc": (["--pad_to_multiple_of", "abc"], "--pad_to_multiple_of 'abc'"),
    "pad 1.5": (["--pad_to_multiple_of=1.5"], "--pad_to_multiple_of '1.5'"),
    "accelerator_config not JSON": (["--accelerator_config", "{split"], "JSON of --accelerator_config"),
    "lora_r 0": (["--use_peft", "--lora_r", "0"], "--lora_r must be a whole number from 1"),
}


@pytest.mark.parametrize("case", list(UNBOUNDED))
def test_unbounded_or_absurd_run_is_refused(case: str, tmp_path: Path) -> None:
    option, named = UNBOUNDED[case]
    line = _one_line([*ANALYZE, *option, "-o", "plan.json"], tmp_path, 2)
    assert named in line and "invalid literal" not in line


@pytest.mark.parametrize("config", ["per_device_train_batch_size: [1, 2]\n",
                                    "max_steps: null\nnum_train_epochs: null\n", "learning_rate: .nan\n"])
def test_yaml_value_of_the_wrong_type_is_a_usage_error(config: str, tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(config)
    line = _one_line([*ANALYZE, "--config", "run.yaml"], tmp_path, 2)
    assert line.startswith("Error: --") and ("must be a" in line)


def test_deeply_nested_row_names_the_file_and_line(tmp_path: Path) -> None:
    """pyarrow stops at depth 1024; the readers datasets falls back to crash the process (SIGSEGV, no output)."""
    rows = [json.dumps({"text": "hello"})] * 3 + ['{"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"]
    (tmp_path / "deep.jsonl").write_text("\n".join(rows) + "\n")
    line = _one_line(["analyze", "deep.jsonl", "--model", str(TINY_MODEL), "--no-cache"], tmp_path, 1)
    assert "deep.jsonl" in line and "line 4" in line and "levels deep" in line


@pytest.mark.parametrize("given", [[str(ROOT / "examples" / "tldr-sample.jsonl")], ["--method", "grpo"],
                                   ["--eval-dataset", str(CAPYBARA)]])
def test_options_given_with_a_plan_are_checked_against_it(given: list[str], tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_bytes(_text(_plan()))
    line = _one_line(["warm", "--plan", "plan.json", "--device", "cpu", "--cache-dir", "cache", *given], tmp_path,
                     2 if "--eval-dataset" in given else 1)
    assert "plan" in line and (given[-1] in line or "grpo" in line or "--eval-dataset" in line)


def test_manifest_in_the_way_fails_the_warm_up_before_compiling(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_bytes(_text(_plan()))
    (tmp_path / "cache" / "shapeplan-manifest.json.lock").mkdir(parents=True)
    line = _one_line(["warm", "--plan", "plan.json", "--device", "cpu", "--cache-dir", "cache"], tmp_path, 1)
    assert "shapeplan-manifest.json.lock is not a file" in line


def _in_private_mount(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`script` (sh) in a user and mount namespace of its own, where it may mount tmpfs file systems that vanish
    with it; skipped where the kernel does not allow one."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip("no user namespaces here (unshare -rm)")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)


@pytest.mark.slow
def test_warm_on_a_full_file_system_exits_1(tmp_path: Path) -> None:
    """A real one-shape warm-up compiles, then cannot record it: no exit 0 ("cached") without a manifest."""
    (tmp_path / "plan.json").write_bytes(_text(_plan()))
    (tmp_path / "full").mkdir()
    done = _in_private_mount(f"mount -t tmpfs -o size=64k tmpfs full && dd if=/dev/zero of=full/fill bs=4k "
                             f"2>/dev/null; {SHAPEPLAN} warm --plan plan.json --device cpu --cache-dir full/cache",
                             tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].startswith("Error: cannot write manifest ") and "Traceback" not in done.stderr


def test_read_only_file_system_is_one_line(tmp_path: Path) -> None:
    from tests.cache.test_archive import _warmed_cache

    (tmp_path / "plan.json").write_bytes(_text(_plan()))
    _warmed_cache(tmp_path / "warmed")
    assert _console(["cache", "export", "--cache-dir", "warmed", "-o", "a.tar.gz"], tmp_path).returncode == 0
    (tmp_path / "ro").mkdir()
    done = _in_private_mount(f"mount -t tmpfs -o ro tmpfs ro && {SHAPEPLAN} cache import a.tar.gz --cache-dir ro; "
                             f"echo; {SHAPEPLAN} warm --plan plan.json --device cpu --cache-dir ro/cache", tmp_path)
    lines = done.stderr.splitlines()
    assert lines == [f"Error: cannot write into {tmp_path / 'ro'} (Read-only file system); import into a writable "
                     "--cache-dir", f"Error: cache dir {tmp_path / 'ro' / 'cache'} is not writable (its folder "
                     f"{tmp_path / 'ro'} is not); pass a writable folder with --cache-dir"], done.stderr[-2000:]


def test_symlink_loop_as_cache_dir_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_bytes(_text(_plan()))
    (tmp_path / "loop").symlink_to("loop")
    for command in ("warm", "verify"):
        assert "is a loop of symbolic links" in _one_line(
            [command, "--plan", "plan.json", "--device", "cpu", "--cache-dir", "loop"], tmp_path, 1)


@pytest.mark.parametrize("args", [["--version"], ["analyze", "--help"], ["cache", "inspect", "a.tar.gz", "--json"]])
def test_stdout_on_a_full_device_is_one_line(args: list[str], tmp_path: Path) -> None:
    from tests.cache.test_archive import _warmed_cache

    _warmed_cache(tmp_path / "warmed")
    assert _console(["cache", "export", "--cache-dir", "warmed", "-o", "a.tar.gz"], tmp_path).returncode == 0
    with open("/dev/full", "w") as full:
        done = subprocess.run([SHAPEPLAN, *args], cwd=tmp_path, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["Error: cannot write to stdout: No space left on device; redirect it to a "
                                        "file or device with room (or write a plan with -o PLAN)"]


def test_export_of_a_growing_cache_is_a_snapshot_or_a_refusal(tmp_path: Path) -> None:
    from tests.cache.test_archive import _warmed_cache

    cache = _warmed_cache(tmp_path / "cache")
    writer = subprocess.Popen([sys.executable, "-c", "import sys\nwith open(sys.argv[1], 'ab') as f:\n while True:\n"
                               "  f.write(b'x' * 65536); f.flush()", str(cache / "fxgraph" / "growing.bin")])
    try:
        done = _console(["cache", "export", "--cache-dir", "cache", "-o", "a.tar.gz"], tmp_path)
    finally:
        writer.kill()
        writer.wait()
    if done.returncode == 0:  # a consistent snapshot: it imports
        assert _console(["cache", "import", "a.tar.gz", "--cache-dir", "imported"], tmp_path).returncode == 0
    else:
        assert done.returncode == 1 and "changed while it was exported" in done.stderr.splitlines()[-1]
        assert not (tmp_path / "a.tar.gz").exists()


def test_guard_of_a_missing_module_is_one_line(tmp_path: Path) -> None:
    assert "no module named 'no_such_module_xyz'" in _one_line(
        ["guard", "--", "python", "-m", "no_such_module_xyz"], tmp_path, 2)


def test_hub_id_offline_is_one_line_naming_the_download(tmp_path: Path) -> None:
    """conftest turns offline mode on; an unreachable Hub turns it on too (after one probe)."""
    line = _one_line(["analyze", "no-such-org/no-such-data", "--model", str(TINY_MODEL), "--no-cache"], tmp_path, 1)
    assert "offline mode is on" in line and "hf download no-such-org/no-such-data --repo-type dataset" in line
    line = _one_line(["analyze", str(CAPYBARA), "--model", "no-such-org/no-such-model", "--no-cache"], tmp_path, 1)
    assert "offline mode is on" in line and "hf download no-such-org/no-such-model --local-dir" in line


def _model_copy(tmp_path: Path, name: str) -> Path:
    import shutil

    return Path(shutil.copytree(TINY_MODEL, tmp_path / name))


def test_broken_model_folders_are_named(tmp_path: Path) -> None:
    truncated = _model_copy(tmp_path, "truncated")
    (truncated / "config.json").write_text((TINY_MODEL / "config.json").read_text()[:40])
    untokenized = _model_copy(tmp_path, "untokenized")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (untokenized / name).unlink()
    assert "model folder untokenized has no tokenizer files" in _one_line(
        ["analyze", str(CAPYBARA), "--model", "untokenized", "--no-cache"], tmp_path, 1)
    assert "model folder truncated is unusable" in _one_line(
        ["analyze", str(CAPYBARA), "--model", "truncated", "--no-cache"], tmp_path, 1)
    # a refused warm-up removes the cache dir (and its parents) it made
    plan = _plan()
    plan["config"]["argv"] = ["--model_name_or_path", str(truncated), "--dataset_name", str(CAPYBARA)]
    (tmp_path / "plan.json").write_bytes(_text(plan))
    assert "truncated" in _one_line(["warm", "--plan", "plan.json", "--device", "cpu", "--cache-dir", "new/cache"],
                                    tmp_path, 1)
    cut = _model_copy(tmp_path, "cut")
    with open(cut / "model.safetensors", "r+b") as weights:
        weights.truncate((TINY_MODEL / "model.safetensors").stat().st_size // 2)
    plan["config"]["argv"] = ["--model_name_or_path", str(cut), "--dataset_name", str(CAPYBARA)]
    (tmp_path / "plan.json").write_bytes(_text(plan))
    assert "model.safetensors is truncated" in _one_line(
        ["warm", "--plan", "plan.json", "--device", "cpu", "--cache-dir", "new/cache"], tmp_path, 1)


@pytest.mark.parametrize("case", ["template syntax", "template raises", "formats mixed", "string prompt, list "
                                  "completion"])
def test_bad_rows_and_templates_name_the_cause(case: str, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }" if case == "template syntax"
                                        else "{{ raise_exception('no system role') }}")
    rows = {"formats mixed": [{"messages": messages}, {"prompt": "a", "completion": "b"}],
            "string prompt, list completion": [{"prompt": "a", "completion": messages[1:]}]}.get(case)
    args = [str(CAPYBARA), "--chat_template_path", "bad.jinja"]
    if rows is not None:
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        args = ["rows.jsonl"]
    line = _one_line(["analyze", *args, "--model", str(TINY_MODEL), "--no-cache"], tmp_path, 1)
    assert (("chat template fails" in line) if rows is None else ("one format" in line)), line


def test_streaming_histogram_refusal_writes_no_plan(tmp_path: Path) -> None:
    _one_line([*ANALYZE, "--dataset_streaming", "--max_steps", "2", "--histogram", "-o", "plan.json"], tmp_path, 2)


def test_seq_beyond_the_model_is_a_warning(tmp_path: Path) -> None:
    model = _model_copy(tmp_path, "short")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    done = _console(["analyze", str(CAPYBARA), "--model", "short", "--max_length", "256", "--no-cache"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "beyond short's max_position_embeddings 128: lower --max_length" in done.stdout


# -- issue 32: the store, outputs, config files, counts --------------------------------------------------------


@pytest.fixture(scope="module")
def pushed_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding `warmed` (a warmed cache dir) and `store` (it pushed), pushed once for the module."""
    from tests.cache.test_archive import _warmed_cache

    folder = tmp_path_factory.mktemp("pushed")
    _warmed_cache(folder / "warmed")
    done = _console(["cache", "push", "--cache-dir", "warmed", "store"], folder)
    assert done.returncode == 0, done.stderr[-2000:]
    return folder


def _pushed(pushed_store: Path, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A copy of the pushed store and warmed cache dir in `tmp_path`: the store's one manifest, its path and body."""
    import shutil

    for name in ("warmed", "store"):
        shutil.copytree(pushed_store / name, tmp_path / name, symlinks=True)
    (manifest,) = (tmp_path / "store" / "manifests").rglob("*.json")
    return manifest, json.loads(manifest.read_text())


def _first(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    path = sorted(body["files"])[0]
    return path, body["files"][path]


def _added(path: str) -> Any:
    def edit(body: dict[str, Any]) -> None:
        body["files"][path] = _first(body)[1]
    return edit


def _resized(delta: int) -> Any:
    def edit(body: dict[str, Any]) -> None:
        _first(body)[1]["size"] += delta
    return edit


# Each edit of a pushed manifest makes `cache pull` refuse it in one line, before anything is written into a cache
# dir that lacks one of the pushed files (it stays usable: `export` does not refuse it).
STORE_EDITS = {
    "a path under the manifest's lock": _added("shapeplan-manifest.json.lock/x"),
    "a path up and out": _added("../outside"),
    "a file and a folder of one name": lambda body: _added(_first(body)[0] + "/x")(body),
    "a size below the object's": _resized(-1),
    "a size above the object's": _resized(+1),
    "a missing object": lambda body: _first(body)[1].update(sha256="0" * 64),
}


@pytest.mark.parametrize("case", list(STORE_EDITS))
def test_hostile_store_manifest_is_refused_before_anything_is_written(case: str, pushed_store: Path,
                                                                      tmp_path: Path) -> None:
    import shutil

    manifest, body = _pushed(pushed_store, tmp_path)
    shutil.copytree(tmp_path / "warmed", tmp_path / "mine")
    (tmp_path / "mine" / _first(body)[0]).unlink()  # the pull has an object to download
    STORE_EDITS[case](body)
    manifest.write_text(json.dumps(body))
    line = _one_line(["cache", "pull", "store", "--cache-dir", "mine", "--device", "cpu"], tmp_path, 1)
    assert "store" in line
    if case == "a missing object":
        assert "is missing from the store" in line and "push again" in line and "bucket" not in line
    if case == "a path under the manifest's lock":
        assert _console(["cache", "export", "--cache-dir", "mine", "-o", "a.tar.gz"], tmp_path).returncode == 0


@pytest.mark.parametrize("path", ["shapeplan-manifest.json.lock/x", "shapeplan-manifest.0-of-2.json",
                                  "sub/shapeplan-manifest.json", "../x", "a/../../x", "/tmp/x", "a//b", "./a", "",
                                  "a/\x00b", "a/\nb", ".shapeplan-pulling-1/journal.json", ".shapeplan-import-complete",
                                  "a/b.lock", "a/b.tmp", "a/b.tmp.AbC123", "a/" + "x" * 300, "a/" * 600 + "b"])
def test_store_path_a_pull_may_not_write(path: str) -> None:
    from shapeplan.cache.store import safe_cache_path

    assert not safe_cache_path(path)
    assert safe_cache_path("fxgraph/ab/graph.bin") and safe_cache_path("neuronxcc-2.x/MODULE_1/model.neff")


@pytest.mark.parametrize("kind", ["a link to /dev/zero", "a FIFO", "a folder"])
def test_store_manifest_that_is_no_regular_file_is_refused_in_seconds(kind: str, pushed_store: Path,
                                                                      tmp_path: Path) -> None:
    manifest, _ = _pushed(pushed_store, tmp_path)
    manifest.unlink()
    if kind == "a FIFO":
        os.mkfifo(manifest)
    elif kind == "a folder":
        manifest.mkdir()
        (manifest / "x.json").write_text("{}")
    else:
        manifest.symlink_to("/dev/zero")
    line = _one_line(["cache", "ls", "store"], tmp_path, 1)
    assert ("not a regular file" in line) or ("not a shapeplan store manifest" in line)


def _journal(links: list[list[Any]], sections: dict[str, Any]) -> bytes:
    return json.dumps({"links": links, "sections": sections}).encode()


JOURNALS = {"cut short": lambda text: text[: len(text) // 2], "not UTF-8": lambda text: b"\xff" + text,
            "names a path outside": lambda text: text.replace(b'"aotautograd/', b'"../aotautograd/'),
            "names a missing staged file": lambda text: text}


@pytest.mark.parametrize("case", list(JOURNALS))
def test_killed_pull_with_a_broken_journal_is_discarded_and_the_pull_completes(case: str, pushed_store: Path,
                                                                               tmp_path: Path) -> None:
    import hashlib

    from shapeplan.cache.contents import PULL_JOURNAL, PULL_STAGING
    from shapeplan.warm.manifest import read_merged
    from tests.cache.test_archive import FILES

    _pushed(pushed_store, tmp_path)
    staging = tmp_path / "target" / f"{PULL_STAGING}999999-killed"
    staging.mkdir(parents=True)
    links = []
    for name, data in FILES.items():
        digest = hashlib.sha256(data).hexdigest()
        if case != "names a missing staged file":
            (staging / digest).write_bytes(data)
        links.append([digest, name, 0o644])
    sections = {k: {"environment": s["environment"], "shapes": s["shapes"]}
                for k, s in read_merged(tmp_path / "warmed").environments.items()}
    (staging / PULL_JOURNAL).write_bytes(JOURNALS[case](_journal(links, sections)))
    done = _console(["cache", "pull", "store", "--cache-dir", "target", "--device", "cpu"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert {n: (tmp_path / "target" / n).read_bytes() for n in FILES} == FILES
    assert not list((tmp_path / "target").glob(f"{PULL_STAGING}*")) and not (tmp_path / "aotautograd").exists()
    assert sorted(read_merged(tmp_path / "target").environments.popitem()[1]["shapes"]) == ["train 2x128"]


@pytest.mark.parametrize("url", ["", "warmed", "warmed/store", "memory://store", "zip::file://a.zip", "ftp://h/x",
                                 "ftp://127.0.0.1:9", "http://h/x"])
def test_store_url_no_store_can_live_at_is_a_usage_error(url: str, tmp_path: Path) -> None:
    from tests.cache.test_archive import _warmed_cache

    _warmed_cache(tmp_path / "warmed")
    line = _one_line(["cache", "push", "--cache-dir", "warmed", url], tmp_path, 2)
    assert "store" in line or "URL" in line or "chains" in line


@pytest.mark.parametrize("endpoint", ["not a url", "http://[::1", "ftp://s3.example.com", "http://h:99999"])
def test_malformed_endpoint_is_a_usage_error(endpoint: str, tmp_path: Path) -> None:
    assert "AWS_ENDPOINT_URL" in _one_line(["cache", "ls", "s3://bucket/x"], tmp_path, 2, AWS_ENDPOINT_URL=endpoint)


def test_endpoint_that_never_answers_times_out(tmp_path: Path) -> None:
    """An endpoint that accepts connections and never answers (a loopback server started here): one line after
    STORE_ATTEMPTS requests of SHAPEPLAN_STORE_TIMEOUT each, not a hang (the default 20 s held it past two minutes
    when botocore's and s3fs's retries multiplied)."""
    import socket
    import threading
    import time

    from shapeplan.cache.store import STORE_ATTEMPTS

    pytest.importorskip("s3fs")
    accepted: list[socket.socket] = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)

        def hold() -> None:
            while True:
                try:
                    accepted.append(server.accept()[0])  # held open, never answered
                except OSError:  # closed: the test is over
                    return

        threading.Thread(target=hold, daemon=True).start()
        started = time.monotonic()
        line = _one_line(["cache", "ls", "s3://bucket/x"], tmp_path, 1,
                         AWS_ENDPOINT_URL=f"http://127.0.0.1:{server.getsockname()[1]}",
                         AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_DEFAULT_REGION="us-east-1",
                         AWS_EC2_METADATA_DISABLED="true", SHAPEPLAN_STORE_TIMEOUT="2")
    for held in accepted:
        held.close()
    assert time.monotonic() - started < 60
    assert len(accepted) <= STORE_ATTEMPTS
    assert "s3://bucket/x" in line and "network" in line and "SHAPEPLAN_STORE_TIMEOUT" in line


def test_cache_ls_of_a_missing_dir_is_one_line(tmp_path: Path) -> None:
    assert "does not exist" in _one_line(["cache", "ls", "--cache-dir", "nowhere"], tmp_path, 1)


# Outputs refused before the command's work: (args, exit code, what the line names). `plan.json` is a valid plan,
# `run.yaml` a config, `warmed` a warmed cache dir, `fifo` a FIFO nobody reads.
WARM = ["warm", "--plan", "plan.json", "--device", "cpu", "--cache-dir", "warmed"]
OUTPUTS = {
    "--env-file is the plan": ([*WARM, "--env-file", "plan.json"], 2, "which this command reads"),
    "--env-file is the manifest": ([*WARM, "--env-file", "warmed/shapeplan-manifest.json"], 2, "manifest"),
    "--env-file in the cache dir": ([*WARM, "--env-file", "warmed/env.sh"], 2, "inside the cache dir"),
    "--env-file a folder": ([*WARM, "--env-file", "warmed"], 2, "is a directory"),
    "--env-file in no folder": ([*WARM, "--env-file", "no/env.sh"], 1, "does not exist"),
    "-o is the config": (["analyze", "--config", "run.yaml", "-o", "run.yaml"], 2, "which this command reads"),
    "-o is the dataset": (["analyze", str(CAPYBARA), "-o", str(CAPYBARA)], 2, "which this command reads"),
    "-o is the compared record": (["analyze", "--compare", "plan.json", "-o", "plan.json"], 2, "reads"),
    "-o empty": (["analyze", "-o", ""], 2, "-o is empty"),
    "--record is the plan": (["guard", "--plan", "plan.json", "--record", "plan.json", "--", "python", "-c", "0"], 2,
                             "which this command reads"),
    "--record in the cache dir": (["guard", "--record", "warmed/run.json", "--", "python", "-c", "0"], 2,
                                  "compile cache"),
    "--report unwritable": (["doctor", "--device", "neuron", "--report", "/proc/report.json"], 1,
                            "cannot write --report"),
    "--report a folder": (["doctor", "--device", "neuron", "--report", "warmed"], 2, "is a directory"),
    "export -o a FIFO": (["cache", "export", "--cache-dir", "warmed", "-o", "fifo"], 2, "not a regular file"),
    "--push into the cache dir": ([*WARM, "--push", "warmed"], 2, "is the cache dir"),
    "--pull of memory://": ([*WARM, "--pull", "memory://store"], 2, "memory://"),
    "export -o inside the cache dir": (["cache", "export", "--cache-dir", "warmed", "-o", "warmed/a.tar.gz"], 2,
                                       "inside the cache dir"),
}


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_output_that_would_destroy_is_refused_before_the_work(case: str, tmp_path: Path) -> None:
    from tests.cache.test_archive import _warmed_cache

    args, code, named = OUTPUTS[case]
    (tmp_path / "plan.json").write_bytes(_text(_plan()))
    (tmp_path / "run.yaml").write_text(f"model_name_or_path: {TINY_MODEL}\ndataset_name: {CAPYBARA}\n")
    _warmed_cache(tmp_path / "warmed")
    os.mkfifo(tmp_path / "fifo")
    assert named in _one_line(args, tmp_path, code, SHAPEPLAN_CACHE_DIR=str(tmp_path / "plans"))


def test_outputs_go_into_devices_and_fifos_in_place(tmp_path: Path) -> None:
    """A character device or a FIFO is written, never replaced by a regular file; a FIFO nobody reads is refused
    instead of blocking; a link is written through."""
    import stat
    import threading

    from shapeplan.errors import ShapeplanError
    from shapeplan.plan.targets import write_output

    write_output("/dev/null", "x\n", "-o")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ShapeplanError, match="FIFO nobody reads"):
        write_output(fifo, "x\n", "-o")
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    for _ in range(200):  # until the reader has the FIFO open
        try:
            write_output(fifo, "plan\n", "-o")
            break
        except ShapeplanError:
            threading.Event().wait(0.01)
    reader.join(10)
    assert got == [b"plan\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    write_output(tmp_path / "link.json", "new", "-o")
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real.json").read_text() == "new"


# Counts refused before anything is sized by them: (args, environment, what the line names).
COUNTS = {
    "--shard 0/30000000": (["--shard", "0/30000000"], {}, "--shard"),
    "--shard of 5000 digits": (["--shard", "0/" + "9" * 5000], {}, "--shard"),
    "Slurm count 10^12": ([], {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": str(10 ** 12)}, "SLURM"),
    "Slurm max 10^9": ([], {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_MIN": "0",
                            "SLURM_ARRAY_TASK_MAX": str(10 ** 9)}, "SLURM"),
    "Batch size of 5000 digits": ([], {"AWS_BATCH_JOB_ARRAY_INDEX": "0", "AWS_BATCH_JOB_ARRAY_SIZE": "9" * 5000},
                                  "AWS_BATCH_JOB_ARRAY_SIZE"),
    "Kubernetes --shard-count 10^9": (["--shard-count", str(10 ** 9)], {"JOB_COMPLETION_INDEX": "0"},
                                      "JOB_COMPLETION_INDEX"),
    "Slurm id of superscript digits": ([], {"SLURM_ARRAY_TASK_ID": "²", "SLURM_ARRAY_TASK_COUNT": "2"}, "SLURM"),
    # before TRL's parser reads them, which blamed the plan's options (exit 1)
    "RANK past WORLD_SIZE": ([], {"WORLD_SIZE": "4", "RANK": "9"}, "RANK='9' is not a process index below 4"),
}


@pytest.mark.parametrize("case", list(COUNTS))
def test_absurd_count_is_refused_before_allocation(case: str, tmp_path: Path) -> None:
    args, env, named = COUNTS[case]
    (tmp_path / "plan.json").write_bytes(_text(_plan()))
    assert named in _one_line(["warm", "--plan", "plan.json", "--device", "cpu", "--cache-dir", "cache", *args],
                              tmp_path, 2, **env)


@pytest.mark.parametrize("cores", ["0-1000000000", "0-" + "9" * 5000, "3-1", "²", "0,a"])
def test_visible_core_list_is_bounded(cores: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from shapeplan.errors import UsageError
    from shapeplan.warm.backends.neuron import parse_cores, visible_cores

    with pytest.raises(UsageError, match="NEURON_RT_VISIBLE_CORES"):
        parse_cores(cores)
    assert parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    for count in (str(10 ** 9), "9" * 5000, "²"):
        monkeypatch.setenv("NEURON_RT_NUM_CORES", count)
        with pytest.raises(UsageError, match="NEURON_RT_NUM_CORES"):
            visible_cores()


def test_split_past_the_task_count_is_cheap_and_leaves_the_rest_empty() -> None:
    from types import SimpleNamespace

    from shapeplan.warm.shards import MAX_SHARDS, split

    tasks = [SimpleNamespace(cost=float(i), batch=1, seq=128, key=f"t{i}") for i in range(5)]
    shares = split(tasks, MAX_SHARDS)
    assert len(shares) == MAX_SHARDS and sum(map(len, shares)) == 5 and shares[5:] == [[]] * (MAX_SHARDS - 5)
    assert shares[:5] == split(tasks, 5)


def _pruned_cache(tmp_path: Path, plans: list[str]) -> Path:
    from shapeplan.warm.manifest import MANIFEST, Manifest, environment_key, machine_environment
    from shapeplan.warm.model import ManifestEntry
    from tests.cache.test_archive import _warmed_cache

    environment = {"method": "sft", **machine_environment("cpu")}
    cache = _warmed_cache(tmp_path / "cache", shapes=())
    for i, plan in enumerate(plans):
        Manifest(cache / MANIFEST).record(ManifestEntry(environment_key(environment), f"train 2x{128 * (i + 1)}",
                                                        "compiled", 1.0, plan=plan), environment)
    return cache


@pytest.mark.parametrize("pattern", ["", " ", "ab"])
def test_prune_pattern_of_no_single_plan_is_refused(pattern: str, tmp_path: Path) -> None:
    _pruned_cache(tmp_path, ["ab1111111111", "ab2222222222"])
    line = _one_line(["cache", "prune", "--cache-dir", "cache", "--fingerprint", pattern], tmp_path, 2)
    assert ("ab1111111111" in line and "ab2222222222" in line) if pattern == "ab" else "empty" in line


def test_prune_plan_takes_a_plan_file(tmp_path: Path) -> None:
    from shapeplan.warm.manifest import read_merged
    from shapeplan.warm.runner import plan_id

    (tmp_path / "plan.json").write_bytes(_text(_plan()))
    mine = plan_id(load_plan(tmp_path / "plan.json"))
    _pruned_cache(tmp_path, [mine, "ff0000000000"])
    done = _console(["cache", "prune", "--cache-dir", "cache", "--plan", "plan.json"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (section,) = read_merged(tmp_path / "cache").environments.values()
    assert [e["plan"] for e in section["shapes"].values()] == ["ff0000000000"]
    assert "no such plan file" in _one_line(["cache", "prune", "--cache-dir", "cache", "--plan", "gone.json"],
                                            tmp_path, 2)


def _laughs(levels: int = 9) -> str:
    lines = ['l0: &l0 "ha"'] + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


CONFIGS: dict[str, tuple[bytes, str]] = {
    "billion laughs": (_laughs().encode(), "aliases"),
    "5000 levels deep": (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "levels deep"),
    "non-UTF-8": (b"max_length: 128\nchat_template: \"\xff\xfe\"\n", "not UTF-8"),
    "over 4 MiB": (b"a: " + b"x" * (5 << 20) + b"\n", "MiB"),
    "a list": (b"- 1\n- 2\n", "YAML mapping"),
    "bad YAML": (b"a: [1, 2\n", "not valid YAML"),
}


@pytest.mark.parametrize("command", [["analyze", "--no-cache"], ["guard", "--", "trl", "sft"]])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_hostile_config_file_is_one_line_in_seconds(case: str, command: list[str], tmp_path: Path) -> None:
    """`analyze` and `guard -- trl sft` read the file through one check (adapters/config_file.py)."""
    import time

    data, named = CONFIGS[case]
    (tmp_path / "run.yaml").write_bytes(data)
    started = time.monotonic()
    line = _one_line([*command, "--config", "run.yaml"], tmp_path, 2)
    assert named in line and "run.yaml" in line and "; " in line  # the problem, then the fix
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("args", [["--config"], ["--config", "a.yaml", "--config", "a.yaml"], ["--", "trl"],
                                  ["guard", "--", "trl", "sft", "--config"]])
def test_wrong_cause_messages_name_the_real_problem(args: list[str], tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("max_length: 128\n")
    line = _one_line(args if args[0] == "guard" else ["analyze", "--no-cache", *args], tmp_path, 2)
    assert "fsdp_config" not in line and "Hub" not in line and "dataset" not in line.lower()
    assert ("--config" in line) if "--config" in args else ("trl sft" in line)


def test_config_from_a_pipe_is_read_once(tmp_path: Path) -> None:
    """`--config <(...)`, `--config /dev/stdin`: TRL's parser opens the path again; it gets the bytes read the
    first time."""
    config = f"model_name_or_path: {TINY_MODEL}\ndataset_name: {CAPYBARA}\nmax_length: 256\n"
    done = subprocess.run([SHAPEPLAN, "analyze", "--config", "/dev/stdin", "--no-cache", "--json"], cwd=tmp_path,
                          input=config, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["shapes"][0]["seq"] <= 256


@pytest.mark.parametrize("values", [{"lora_r": 0}, {"lora_r": -3}, {"lora_r": 10 ** 9}, {"lora_dropout": 2.0},
                                    {"lora_dropout": -0.1}, {"lora_alpha": float("nan")}])
def test_lora_values_peft_refuses_are_refused_before_any_shape(values: dict[str, Any]) -> None:
    from types import SimpleNamespace

    from shapeplan.adapters.trl_args import _check_peft
    from shapeplan.errors import UsageError

    model = SimpleNamespace(**{"use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05, **values})
    with pytest.raises(UsageError, match=f"--{next(iter(values))}"):
        _check_peft(model)
    _check_peft(SimpleNamespace(**{**vars(model), "use_peft": False}))  # without --use_peft they are not read


@pytest.mark.parametrize("args", [["warm", "--plan", "/dev/zero"], ["warm", "--plan", "fifo"],
                                  ["analyze", "--config", "/dev/zero"], ["analyze", "--config", "fifo"]])
def test_input_that_is_no_regular_file_is_read_bounded_without_blocking(args: list[str], tmp_path: Path) -> None:
    """/dev/zero ends at the size bound; a FIFO nobody writes reads as empty instead of blocking."""
    os.mkfifo(tmp_path / "fifo")
    line = _one_line([*args, "--device", "cpu", "--cache-dir", "cache"] if args[0] == "warm" else args, tmp_path,
                     1 if args[0] == "warm" else 2)
    assert args[-1] in line


# -- the user's own code: tools modules, environments, rollout functions (issue 53) ------------------------------------

AGENTS = """
import sys


class Stop(BaseException):
    pass


def exit_factory():
    sys.exit("no environment")


def broken_factory():
    raise RuntimeError("no database")


class _Environment:
    def reset(self, **row):
        return None


class ResetExits(_Environment):
    def reset(self, **row):
        sys.exit(0)


class ResetInterrupted(_Environment):
    def reset(self, **row):
        raise KeyboardInterrupt


class ResetInt(_Environment):
    def reset(self, **row):
        return 3


class ResetDict(_Environment):
    def reset(self, **row):
        return {"observation": "x"}


class ResetWithoutKwargs(_Environment):
    def reset(self):
        return None


def _generated(prompts, trainer):
    ids = [[1, 2]] * len(prompts)
    trainer._generate_single_turn(ids, None, {}, 1)
    return ids


def rollout_exits(prompts, trainer):
    sys.exit(3)


def rollout_stops(prompts, trainer):
    raise Stop("halt")


def rollout_none(prompts, trainer):
    return {"prompt_ids": None, "completion_ids": _generated(prompts, trainer), "logprobs": None}


def rollout_ints(prompts, trainer):
    return {"prompt_ids": [1] * len(prompts), "completion_ids": _generated(prompts, trainer), "logprobs": None}


class Weather:
    \"\"\"Get the weather.

    Args:
        city: The city.
    \"\"\"

    def __init__(self, city: str) -> None:
        self.city = city
"""
USER_MODULES = {"agents.py": AGENTS, "exits_at_import.py": "import sys\nsys.exit(0)\n",
                "exits_3_at_import.py": "import sys\nsys.exit(3)\n",
                "lazy.py": "def __getattr__(name):\n    raise RuntimeError('no ' + name)\n"}
GRPO = ["analyze", "--method", "grpo", "--model", str(TINY_MODEL), "--per_device_train_batch_size", "2",
        "--num_generations", "2", "--max_completion_length", "64", "--max_steps", "2", "--cache_implementation",
        "static", "prompts.jsonl", "-o", "plan.json"]


def _agentic(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A folder to run in (with 4 prompts) and the environment that puts the user's modules on the path (a folder of
    their own: importing them writes __pycache__)."""
    from tests.cli.test_agentic_cli import _prompts

    code, run = tmp_path / "code", tmp_path / "run"
    code.mkdir()
    run.mkdir()
    for name, text in USER_MODULES.items():
        (code / name).write_text(text, encoding="utf-8")
    _prompts(tmp_path).rename(run / "prompts.jsonl")
    return run, {"PYTHONPATH": os.pathsep.join([str(code), str(ROOT)])}


# (options, what the one line says): the user's code does not decide shapeplan's exit code (exit 2, every one)
USER_CODE_EXITS = {
    "module exits 0 at import": (["--tools", "exits_at_import:f"],
                                 "--tools 'exits_at_import:f': importing module 'exits_at_import' called sys.exit(0); "
                                 "fix the module so that it imports"),
    "module exits 3 at import": (["--tools", "exits_3_at_import:f"], "called sys.exit(3); fix the module"),
    "module __getattr__ raises": (["--tools", "lazy:f"], "--tools 'lazy:f': reading 'f' from module 'lazy' raised "
                                                         "RuntimeError: no f; fix the module's __getattr__"),
    "factory exits with a message": (["--environment_factory", "agents:exit_factory"],
                                     "the environment factory given (agents:exit_factory) called "
                                     "sys.exit('no environment'); fix it"),
    "reset exits": (["--environment_factory", "agents:ResetExits"],
                    "the environment given's reset (agents:ResetExits.reset) on a row called sys.exit(0); give reset "
                    "a **kwargs parameter"),
    "rollout exits": (["--rollout_func", "agents:rollout_exits"],
                      "--rollout_func agents:rollout_exits, run on a batch of prompts by shapeplan's dry run, called "
                      "sys.exit(3); shapeplan plans a rollout_func"),
    "rollout raises a BaseException": (["--rollout_func", "agents:rollout_stops"], "raised Stop: halt; shapeplan "
                                                                                   "plans a rollout_func"),
}


@pytest.mark.parametrize("case", list(USER_CODE_EXITS))
def test_what_the_users_code_raises_or_exits_with_is_one_line_exit_2(case: str, tmp_path: Path) -> None:
    run, env = _agentic(tmp_path)
    options, said = USER_CODE_EXITS[case]
    assert said in _one_line([*GRPO, *options], run, 2, **env)


def test_ctrl_c_in_the_users_code_is_an_interrupt_and_its_prints_stay_off_stdout(tmp_path: Path) -> None:
    run, env = _agentic(tmp_path)
    interrupted = _console([*GRPO, "--environment_factory", "agents:ResetInterrupted"], run, **env)
    assert (interrupted.returncode, interrupted.stderr.strip()) == (130, "Interrupted."), interrupted.stderr
    (tmp_path / "code" / "noisy.py").write_text("print('hello from the tools module')\n"
                                                "from tests.oracle.agentic_tools import get_weather\n")
    planned = _console([*GRPO[:-2], "--json", "--tools", "noisy:get_weather"], run, **env)
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert json.loads(planned.stdout)["config"]["tools"] == ["get_weather"]  # stdout is the plan alone
    assert "hello from the tools module" in planned.stderr


# (options, a --config file, what the one line says): values GRPOTrainer cannot take, refused with the fix (exit 2)
USER_VALUES = {
    "reset returns an int": (["--environment_factory", "agents:ResetInt"], None,
                             "the environment given's reset (agents:ResetInt.reset) returned int 3, which "
                             "GRPOTrainer cannot append to the prompt's last message; return a str"),
    "reset returns a dict": (["--environment_factory", "agents:ResetDict"], None, "returned dict {'observation': 'x'}"),
    "reset takes no **kwargs": (["--environment_factory", "agents:ResetWithoutKwargs"], None,
                                "raised TypeError: ResetWithoutKwargs.reset() got an unexpected keyword argument "
                                "'prompt'; give reset a **kwargs parameter"),
    "factory raises": (["--environment_factory", "agents:broken_factory"], None,
                       "the environment factory given (agents:broken_factory) raised RuntimeError: no database; "
                       "fix it: GRPOTrainer calls it with no arguments"),
    "rollout returns no prompt_ids": (["--rollout_func", "agents:rollout_none"], None,
                                      "--rollout_func returned prompt_ids as a NoneType, not a list"),
    "rollout returns ints for rows": (["--rollout_func", "agents:rollout_ints"], None,
                                      "--rollout_func returned prompt_ids[0] = 1, not a list of token ids"),
    "a class as a tool": (["--tools", "agents:Weather"], None,
                          "tool 'Weather': its schema cannot be built (a class, not a function or method"),
    "tools of numbers in the config": ([], "tools: [123]\n", "tools is [123] in the config file; give it a list of "
                                                              "module:attr names"),
    "a list of factories in the config": ([], "environment_factory: [agents:ResetInt, agents:ResetDict]\n",
                                          "environment_factory is ['agents:ResetInt', 'agents:ResetDict'] in the "
                                          "config file; give it one module:attr name"),
}


@pytest.mark.parametrize("case", list(USER_VALUES))
def test_what_grpo_trainer_cannot_take_is_one_line_exit_2(case: str, tmp_path: Path) -> None:
    run, env = _agentic(tmp_path)
    options, config, said = USER_VALUES[case]
    if config is not None:
        (tmp_path / "run.yaml").write_text(config, encoding="utf-8")
        options = ["--config", str(tmp_path / "run.yaml")]
    assert said in _one_line([*GRPO, *options], run, 2, **env)


TOOL_LOOPS = {
    "negative iterations": (["--max_tool_calling_iterations", "-1"],
                            "--max_tool_calling_iterations must be 0 or more"),
    # 783 prompt buckets x 784 cache lengths: it exhausted memory after half a minute (pinned, one cache length)
    "100000-token completions": (["--max_completion_length", "100000", "--pin_cache", "false"],
                                 "more than shapeplan plans (100,000)"),
    "unpadded over 20000 rounds": (["--max_completion_length", "4000", "--pad_tool_turns", "false", "--pin_cache",
                                    "false", "--max_steps", "20000"], "more than shapeplan replays (50,000,000)"),
}


@pytest.mark.parametrize("case", list(TOOL_LOOPS))
def test_unbounded_tool_loop_is_refused_in_seconds(case: str, tmp_path: Path) -> None:
    import time

    run, env = _agentic(tmp_path)
    options, said = TOOL_LOOPS[case]
    started = time.monotonic()
    line = _one_line([*GRPO, "--tools", "tests.oracle.agentic_tools:get_weather", *options], run, 2, **env)
    assert said in line, line
    assert time.monotonic() - started < 60


# -- images: read as the run reads them, fetched within bounds ----------------------------------------------------

def _answer(kind: str, client: Any) -> None:
    """What a loopback server answers an image request with."""
    import time

    client.recv(65536)
    if kind == "silent":
        time.sleep(30)
    elif kind == "endless body":
        client.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n\r\n")
        while True:
            client.sendall(b"\0" * (1 << 16))
    elif kind == "a byte at a time":
        client.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(300):
            client.sendall(b"\0")
            time.sleep(0.1)
    elif kind == "404":
        client.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    elif kind == "not HTTP":
        client.sendall(b"SSH-2.0-OpenSSH\r\n")


IMAGES = {  # (the image, environment, exit code, what the one line says)
    "truncated JPEG": ("file", {}, 1, "cannot be used: a corrupt image (image file is truncated"),
    "silent": ("url", {}, 1, "no whole answer within 1 s (SHAPEPLAN_IMAGE_TIMEOUT"),
    "a byte at a time": ("url", {}, 1, "no whole answer within 1 s (SHAPEPLAN_IMAGE_TIMEOUT"),
    "endless body": ("url", {}, 1, "over 1 MiB (SHAPEPLAN_IMAGE_MAX_MIB"),
    "404": ("url", {}, 1, "the server answered HTTP 404 Not Found"),
    "not HTTP": ("url", {}, 1, "cannot fetch it (BadStatusLine"),
    "closed port": ("closed", {}, 1, "cannot fetch it ([Errno 111] Connection refused)"),
    "timeout not a number": ("url", {"SHAPEPLAN_IMAGE_TIMEOUT": "soon"}, 2, "SHAPEPLAN_IMAGE_TIMEOUT='soon' is not "
                                                                            "a number above 0"),
}


@pytest.mark.parametrize("case", list(IMAGES))
def test_image_that_the_run_cannot_read_is_one_line_in_seconds(case: str, tmp_path: Path) -> None:
    """Only loopback servers started here; each answers as `case` says (a thread per request, abandoned when the
    test ends)."""
    import socket
    import threading
    import time

    from PIL import Image

    from tests.conftest import TINY_VL_MODEL

    source, env, code, said = IMAGES[case]
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/cat.png"

        def serve() -> None:
            while True:
                try:
                    client, _ = server.accept()
                except OSError:  # closed: the test is over
                    return
                threading.Thread(target=_guarded, args=(case, client), daemon=True).start()

        if source == "url":
            threading.Thread(target=serve, daemon=True).start()
        image = url
        if source == "file":
            data = io.BytesIO()
            Image.effect_noise((256, 192), 64).convert("RGB").save(data, "JPEG")
            # cut inside the scan data: Pillow's `verify` passes it (it reads a JPEG's markers only)
            (tmp_path / "cut.jpg").write_bytes(data.getvalue()[:len(data.getvalue()) * 3 // 4])
            image = str(tmp_path / "cut.jpg")
        elif source == "closed":
            server.close()
        messages = [{"role": "user", "content": "what is it"}, {"role": "assistant", "content": "a cat"}]
        (tmp_path / "rows.jsonl").write_text(json.dumps({"messages": messages, "images": [image]}) + "\n")
        started = time.monotonic()
        line = _one_line(["analyze", "--method", "sft", "rows.jsonl", "--model", str(TINY_VL_MODEL), "--max_steps",
                          "1", "--no-cache"], tmp_path, code,
                         **{"SHAPEPLAN_IMAGE_TIMEOUT": "1", "SHAPEPLAN_IMAGE_MAX_MIB": "1", **env})
    assert said in line and (image in line or code == 2), line
    assert time.monotonic() - started < 60


def _guarded(kind: str, client: Any) -> None:
    import contextlib

    with client, contextlib.suppress(OSError):  # shapeplan hung up, as it should
        _answer(kind, client)


# -- issue 53, round 4 -------------------------------------------------------------------------------------------------

TIMES = {"1e300": 1e300, "NaN": float("nan")}


@pytest.mark.parametrize("value", list(TIMES))
def test_manifest_time_that_is_no_unix_time_is_one_line(value: str, pushed_store: Path, tmp_path: Path) -> None:
    """A store push's `pushed_at` and a cache dir's `warmed_at` are shown as dates and compared with ages: a
    damaged one is refused naming it, by every command that reads it (ls, prune, push, export)."""
    from shapeplan.warm.manifest import MANIFEST

    manifest, body = _pushed(pushed_store, tmp_path)
    manifest.write_text(json.dumps({**body, "pushed_at": TIMES[value]}))
    assert f"records pushed_at {TIMES[value]!r}, not a Unix time" in _one_line(["cache", "ls", "store"], tmp_path, 1)
    local = tmp_path / "warmed" / MANIFEST
    data = json.loads(local.read_text())
    for section in data["environments"].values():
        for entry in section["shapes"].values():
            entry["warmed_at"] = TIMES[value]
    local.write_text(json.dumps(data))
    for args in (["cache", "ls", "--cache-dir", "warmed"], ["cache", "prune", "--cache-dir", "warmed", "--older-than",
                                                            "1"],
                 ["cache", "push", "--cache-dir", "warmed", "pushed"], ["cache", "export", "--cache-dir", "warmed",
                                                                         "-o", "a.tar.gz"]):
        line = _one_line(args, tmp_path, 1)
        assert f"records warmed_at {TIMES[value]!r} for train 2x128, not a Unix time; delete it" in line, args


@pytest.mark.parametrize("age", ["nan", "inf", "-1", "1e400", "abc"])
def test_prune_age_that_is_no_age_is_a_usage_error(age: str, tmp_path: Path) -> None:
    """NaN compares false with every time: `--older-than nan` pruned nothing and exited 0."""
    _pruned_cache(tmp_path, ["ab1111111111"])
    assert f"--older-than {age!r} is not an age" in _one_line(
        ["cache", "prune", "--cache-dir", "cache", "--older-than", age], tmp_path, 2)


# peft as if not installed: no import finder finds it (as `importlib.util.find_spec`, which TRL asks, sees it)
NO_PEFT = '''import sys


class _Hidden:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        return None if name.split(".")[0] == "peft" else self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [_Hidden(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''


def test_peft_run_without_peft_is_refused_before_the_cache_dir(tmp_path: Path) -> None:
    """It failed every shape, three lines, and left the cache dir and its manifest behind."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(NO_PEFT)
    (tmp_path / "run").mkdir()
    plan = _plan()
    plan["config"]["argv"] += ["--use_peft"]
    (tmp_path / "run" / "plan.json").write_bytes(_text(plan))
    line = _one_line(["warm", "--plan", "plan.json", "--device", "cpu", "--cache-dir", "cache"], tmp_path / "run", 2,
                     PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]))
    assert "--use_peft, and peft is not installed here; install it" in line


def _vision_plan(**shape: Any) -> dict[str, Any]:
    """A valid plan of one vision batch (two rows, one 56x84 image) for the tiny Qwen2.5-VL, its shape updated."""
    from tests.conftest import TINY_VL_MODEL

    plan = _plan(**{"seq": 256, "pixel_values": [24, 1176], "image_grid_thw": [[1, 4, 6]],
                    "text_runs": [[[35, 193], [196]]], **shape})
    plan["config"]["argv"] = ["--model_name_or_path", str(TINY_VL_MODEL), "--dataset_name", str(CAPYBARA)]
    return plan


def test_vision_plan_of_another_pixel_width_is_refused(tmp_path: Path) -> None:
    """warm fed the processor's own 1176-wide rows and recorded the plan's 1000-wide shape as warmed; verify exited
    0."""
    from tests.cache.test_archive import _warmed_cache

    _warmed_cache(tmp_path / "warmed")
    (tmp_path / "plan.json").write_bytes(_text(_vision_plan(pixel_values=[24, 1000])))
    for command, cache in (("warm", "cache"), ("verify", "warmed")):
        line = _one_line([command, "--plan", "plan.json", "--device", "cpu", "--cache-dir", cache], tmp_path, 1)
        assert "pixel_values [24, 1000]" in line and "makes [24, 1176]" in line and "re-create the plan" in line


def _agentic_plan() -> dict[str, Any]:
    """A GRPO plan made with a tool, its tool turns padded (as `analyze --tools` records it)."""
    plan = {**_plan(), "method": "grpo"}
    plan["config"] = {"argv": [*plan["config"]["argv"], "--reward_funcs", "accuracy_reward", "--tools",
                               "tests.oracle.agentic_tools:get_weather"],
                      "tools": ["get_weather"], "environment_factory": None, "pad_tool_turns": True}
    return plan


@pytest.mark.parametrize("option", [["--tools", "tests.oracle.agentic_tools:now"], ["--pad_tool_turns", "false"]])
def test_option_that_contradicts_an_agentic_plan_exits_1(option: list[str], tmp_path: Path) -> None:
    """README: an option given with a plan that does not match it is exit 1; these two were warmed as the plan."""
    (tmp_path / "plan.json").write_bytes(_text(_agentic_plan()))
    line = _one_line(["warm", "--plan", "plan.json", "--device", "cpu", "--cache-dir", "cache", *option], tmp_path, 1)
    assert f"the plan was made for {option[0][2:]}=" in line and "re-create the plan" in line


# (an edit of the tiny Qwen2.5-VL's preprocessor_config.json, what the line names): each failed the resize arithmetic,
# blamed on the first image ("math domain error; fix or drop the row") or a traceback
PROCESSORS = {
    "max_pixels -5": ({"max_pixels": -5}, "max_pixels (size.longest_edge) -5"),
    "max_pixels 0": ({"max_pixels": 0}, "max_pixels (size.longest_edge) 0"),
    "patch_size 0": ({"patch_size": 0}, "patch_size 0"),
    "longest_edge NaN": ({"size": {"longest_edge": float("nan"), "shortest_edge": 3136}},
                         "max_pixels (size.longest_edge) nan"),
}


def _image_rows(tmp_path: Path, images: list[str]) -> Path:
    messages = [{"role": "user", "content": "what is it"}, {"role": "assistant", "content": "a cat"}]
    (tmp_path / "rows.jsonl").write_text(json.dumps({"messages": messages, "images": images}) + "\n")
    return tmp_path / "rows.jsonl"


@pytest.mark.parametrize("case", list(PROCESSORS))
def test_processor_setting_is_named_not_the_image(case: str, tmp_path: Path) -> None:
    import shutil

    from PIL import Image

    from tests.conftest import TINY_VL_MODEL

    edit, named = PROCESSORS[case]
    model = Path(shutil.copytree(TINY_VL_MODEL, tmp_path / "model"))
    config = json.loads((model / "preprocessor_config.json").read_text())
    (model / "preprocessor_config.json").write_text(json.dumps({**config, **edit}))
    Image.new("RGB", (96, 64), (200, 10, 10)).save(tmp_path / "cat.png")
    _image_rows(tmp_path, ["cat.png"])
    for command in ("analyze", "advise"):
        line = _one_line([command, "--method", "sft", "rows.jsonl", "--model", "model", "--max_steps", "1",
                          *(["--no-cache"] if command == "analyze" else [])], tmp_path, 1)
        assert f"model's image processor has {named}, not a whole number of at least 1; fix it in its " \
               "preprocessor_config.json" in line and "cat.png" not in line, line


# (rows, the model, what the line says): lines that named the wrong cause
ROWS = {
    "an image path that is a folder": ({"images": ["x.png"]}, "vl", "image 'x.png' cannot be used: a folder, not an "
                                                                    "image file"),
    "a missing image named like base64": ({"images": ["data"]}, "vl", "image 'data' cannot be used: no such file (nor "
                                                                      "base64 of an image)"),
    "messages and text rows": ({"text": "hello there"}, "text", "the dataset mixes row formats: row 1 has no "
                                                                "'messages' (it has text); give every row one format"),
}


@pytest.mark.parametrize("case", list(ROWS))
def test_bad_row_names_its_real_cause(case: str, tmp_path: Path) -> None:
    from tests.conftest import TINY_VL_MODEL

    second, model, said = ROWS[case]
    (tmp_path / "x.png").mkdir()
    messages = [{"role": "user", "content": "what is it"}, {"role": "assistant", "content": "a cat"}]
    first = {"messages": messages} if model == "text" else {"messages": messages, **second}
    rows = [first, second] if model == "text" else [first]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    line = _one_line(["analyze", "--method", "sft", "rows.jsonl", "--model",
                      str(TINY_VL_MODEL if model == "vl" else TINY_MODEL), "--max_steps", "1", "--no-cache"],
                     tmp_path, 1)
    assert said in line and "NoneType" not in line and "PIL" not in line, line


@pytest.mark.parametrize("pin", ['"abc"', "-1", "1e30", "0"])
def test_cache_pin_that_is_no_cache_length_is_a_usage_error(pin: str, tmp_path: Path) -> None:
    """A string was a traceback; -1 and 1e30 were planned without a word."""
    run, env = _agentic(tmp_path)
    line = _one_line(["advise", *GRPO[1:-2], "--reward_funcs", "accuracy_reward", "--generation_kwargs",
                      f'{{"max_cache_len": {pin}}}'], run, 2, **env)
    assert f"--generation_kwargs max_cache_len is {json.loads(pin)!r}, not a cache length" in line


@pytest.mark.parametrize("endpoint", ["port", "black hole"])
def test_a_hub_endpoint_that_cannot_answer_is_one_line_in_seconds(endpoint: str, tmp_path: Path) -> None:
    """HF_ENDPOINT with a port that is no number: a usage error; one that accepts and never answers (a loopback
    listener started here): the Hub counts as unreachable after the probe's bound, and the Hub id's line says so."""
    import socket
    import time

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # accepts (the kernel's backlog) and never answers
        url = "http://127.0.0.1:abc" if endpoint == "port" else f"http://127.0.0.1:{server.getsockname()[1]}"
        started = time.monotonic()
        line = _one_line(["analyze", "someone/some-dataset", "--model", str(TINY_MODEL), "--no-cache"], tmp_path,
                         2 if endpoint == "port" else 1, HF_ENDPOINT=url, HF_HUB_OFFLINE="0", HF_DATASETS_OFFLINE="0",
                         TRANSFORMERS_OFFLINE="0")
    assert ("port that is not a number" if endpoint == "port" else "cannot be reached") in line, line
    assert time.monotonic() - started < 60


def test_a_rollout_plan_whose_own_generate_calls_warm_cannot_drive_exits_1(tmp_path: Path) -> None:
    """A rollout function's own `generate` calls planned at another max_new_tokens than the trainer's: warm would
    drive them at the trainer's, so it names both and stops before any work."""
    plan = {**_plan(seq=128, cache_len=191, max_new_tokens=64), "method": "grpo"}
    plan["shapes"][0]["phase"] = "generate"
    plan["config"] = {**plan["config"], "argv": [*plan["config"]["argv"], "--reward_funcs", "accuracy_reward"],
                      "max_new_tokens": 256, "rollout_func": "tests.oracle.agentic_tools:rollout"}
    (tmp_path / "plan.json").write_bytes(_text(plan))
    line = _one_line(["warm", "--plan", "plan.json", "--device", "cpu", "--cache-dir", "cache"], tmp_path, 1)
    assert "max_new_tokens [64]" in line and "trainer's (256)" in line and not (tmp_path / "cache").exists(), line
