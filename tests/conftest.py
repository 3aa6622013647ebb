"""Offline, isolated test environment: no Hub, temporary caches, the bundled tiny model and sample data."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY_MODEL = EXAMPLES / "tiny-qwen3"
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


# The files' measured seconds (scripts/test_durations.py writes them from a whole run's JUnit XML). `make test`
# hands xdist whole files in this order (--dist loadfile --no-loadscope-reorder): the longest first, so that no long
# file starts last and holds one worker while the other idles. A file not measured yet goes first.
DURATIONS = Path(__file__).resolve().parent / "durations.json"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    import json

    seconds: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    # A stable sort: within a file the tests keep their order.
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], float("inf")))
