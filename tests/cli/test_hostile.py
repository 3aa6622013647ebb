"""Hostile input through the installed console script: every bad input of issue 12 gives one line on stderr, its
documented exit code (README), and writes nothing (no plan, cache dir, archive or temporary file)."""

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
}


def _console(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "shapeplan"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _files(folder: Path) -> dict[str, bytes]:
    """Everything under `folder` but `inductor/`: conftest points torch's own cache there, which torch creates
    when it is imported (analyze imports it through TRL)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(folder.rglob("*")) if p.relative_to(folder).parts[0] != "inductor"}


def _one_line(args: list[str], cwd: Path, code: int) -> str:
    """Run `args`: exit `code`, one line on stderr, nothing written under `cwd`."""
    before = _files(cwd)
    done = _console(args, cwd)
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
    assert "plan" in line and "re-create" in line
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
