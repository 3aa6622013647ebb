"""Offline, isolated test environment: no Hub, temporary caches, the bundled tiny model and sample data."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY_MODEL = EXAMPLES / "tiny-qwen3"
TINY_VL_MODEL = EXAMPLES / "tiny-qwen2.5-vl"
CAPYBARA = EXAMPLES / "capybara-sample.jsonl"
TLDR = EXAMPLES / "tldr-sample.jsonl"

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
# The tiny model gains nothing from intra-op threads; with two pytest workers on two cores they only contend
# (an oracle run is ~3x faster with one thread). Set before torch is imported; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# datasets reads its cache location at import, so it is set before any test imports it. The processes a test starts
# as ranks of an `accelerate launch` (RANK set) keep their test's caches: TRL's ranks share one datasets cache.
if "RANK" not in os.environ or "SHAPEPLAN_TESTS_CACHE" not in os.environ:
    _session_cache = tempfile.mkdtemp(prefix="shapeplan-tests-")
    atexit.register(shutil.rmtree, _session_cache, True)
    os.environ["SHAPEPLAN_TESTS_CACHE"] = _session_cache
    os.environ["HF_DATASETS_CACHE"] = str(Path(_session_cache) / "datasets")
    os.environ["HF_HOME"] = str(Path(_session_cache) / "hf")


def write_files_by_length(source: Path, folder: Path, files: int) -> Path:
    """`folder` holding `source`'s rows sorted by length in `files` JSONL files of equal row counts (the shortest
    rows in 0.jsonl): a stream whose file order decides which rows are batched together."""
    folder.mkdir()
    lines = sorted(source.read_text().splitlines(keepends=True), key=len)
    size = len(lines) // files
    for index in range(files):
        (folder / f"{index}.jsonl").write_text("".join(lines[index * size:(index + 1) * size]))
    return folder


def write_short_text_rows(path: Path, rows: int, *, column: str = "text", max_words: int = 24) -> Path:
    """`rows` short plain-text rows of 1 to `max_words` words in `column`, seeded: a stream long enough to cross
    TRL's 1000-row pack batches (or the shuffle buffer) with a few seconds of tokenization."""
    import json
    import random

    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "owls", "watch"]
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({column: " ".join(rng.choices(words, k=rng.randint(1, max_words)))}) + "\n")
    return path


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("SHAPEPLAN_CACHE_DIR", str(tmp_path / "shapeplan"))


@dataclass(frozen=True)
class WarmedSFT:
    """One real torch.compile warm-up of the (2, 128) SFT shape (`SFT_128_ARGV` on CAPYBARA) into `cache`, with
    `--json` (`report`) and `--env-file` (`env_file`), shared by the tests that only read what it left (a test that
    changes the cache works on a copy)."""

    folder: Path
    plan: Path
    cache: Path
    report: dict[str, Any]
    env: dict[str, str]

    @property
    def env_file(self) -> Path:
        return self.folder / "shapeplan.env"


# One shape, (2, 128): every row is cut or padded to 128.
SFT_128_ARGV = ["--max_length", "128", "--per_device_train_batch_size", "2", "--max_steps", "2", "--torch_compile",
                "true"]


@pytest.fixture(scope="session")
def warmed_sft(tmp_path_factory: pytest.TempPathFactory) -> WarmedSFT:
    """The session's `WarmedSFT`: warmed by the first xdist worker that asks, under a lock the other waits on (a
    compile costs a minute of CPU; each test that needs one warmed its own before)."""
    import json

    from filelock import FileLock

    from tests import console
    from tests.warm.harness import run_argv

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one run
    shared = tmp_path_factory.getbasetemp().parent / f"shared-{run}" if run else tmp_path_factory.getbasetemp()
    folder = shared / "warmed-sft-128"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SHAPEPLAN_CACHE_DIR": str(folder / "shapeplan")}
    warmed = WarmedSFT(folder, folder / "plan.json", folder / "cache", {}, env)
    shared.mkdir(parents=True, exist_ok=True)
    with FileLock(str(shared / "warmed-sft-128.lock")):
        report = folder / "report.json"
        if not report.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
            folder.mkdir()
            analyzed = console.run(["analyze", *run_argv(CAPYBARA, SFT_128_ARGV, folder / "out"), "-o",
                                    str(warmed.plan)], env=env)
            assert analyzed.returncode == 0, analyzed.stderr
            done = console.run(["warm", "--plan", str(warmed.plan), "--device", "cpu", "--cache-dir",
                                str(warmed.cache), "--json", "--env-file", str(warmed.env_file)], env=env)
            assert done.returncode == 0, done.stderr[-3000:]
            report.write_text(done.stdout, encoding="utf-8")  # last: its presence means the rest is there
    return WarmedSFT(folder, warmed.plan, warmed.cache, json.loads(report.read_text(encoding="utf-8")), env)


# The files' measured seconds (scripts/test_durations.py writes them from a whole run's JUnit XML). `make test`
# hands xdist whole files in this order (--dist loadfile --no-loadscope-reorder): the longest first, so that no long
# file starts last and holds one worker while the other idles. A file not measured yet goes first.
DURATIONS = Path(__file__).resolve().parent / "durations.json"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    import json

    seconds: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    # A stable sort: within a file the tests keep their order.
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], float("inf")))
