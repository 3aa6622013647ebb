"""`shapeplan cache ls` and `cache prune` on local cache dirs: the plans warmed into a dir (grouped by the plan
fingerprint each manifest entry records), their counts, age and the dir's size; pruning a plan's or old shapes, with
`--dry-run` removing nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

from shapeplan.cache.listing import scan_cache_dir
from shapeplan.warm.manifest import MANIFEST, Manifest, environment_key, machine_environment, read_merged
from shapeplan.warm.model import ManifestEntry
from tests.cache.test_archive import FILES, _tree, _warmed_cache
from tests.cache.test_store import console
from tests.cli.test_exit_codes import ok

ENVIRONMENT = {"method": "sft", "model": "examples/tiny-qwen3", **machine_environment("cpu")}
DAY = 86400.0


def _cache(folder: Path) -> Path:
    """Plan aaaa (two shapes warmed an hour ago, one failed) and plan bbbb (one shape warmed 40 days ago)."""
    cache = _warmed_cache(folder, shapes=())
    manifest, key, now = Manifest(folder / MANIFEST), environment_key(ENVIRONMENT), time.time()
    for task, status, plan, at in [("train 2x128", "compiled", "aaaa11112222", now - 3600),
                                   ("train 2x256", "cached", "aaaa11112222", now - 3000),
                                   ("eval 2x64 per_pass=1", "failed", "aaaa11112222", now - 2000),
                                   ("train 4x512", "compiled", "bbbb33334444", now - 40 * DAY)]:
        manifest.record(ManifestEntry(key, task, status, 1.0, plan=plan, warmed_at=at), ENVIRONMENT)
    return cache


def test_scan_groups_the_shapes_by_plan_with_counts_age_and_size(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "cache")
    info = scan_cache_dir(cache)
    assert (info.files, info.size_on_disk) == (len(FILES) + 1, sum(len(d) for d in _tree(cache).values()))
    recent, old = info.plans
    assert (recent.plan, recent.model, recent.method, recent.warmed, recent.failed) == \
        ("aaaa11112222", "examples/tiny-qwen3", "sft", 2, 1)
    assert (old.plan, old.warmed, old.failed) == ("bbbb33334444", 1, 0)
    assert time.time() - 3100 < recent.last_warmed < time.time() - 2900  # the last warmed shape, not the failed one
    assert scan_cache_dir(tmp_path / "never-warmed").plans == ()


def test_ls_lists_each_cache_dir_as_json_and_as_a_table(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "cache")
    listing = json.loads(ok(console("cache", "ls", "--cache-dir", cache, "--json")))
    (entry,) = listing["cache_dirs"]
    assert [(p["plan"], p["warmed"], p["failed"]) for p in entry["plans"]] == [("aaaa11112222", 2, 1),
                                                                               ("bbbb33334444", 1, 0)]
    table = ok(console("cache", "ls", "--cache-dir", cache)).splitlines()
    assert table[0].startswith(str(cache.resolve()))
    assert table[1].split() == ["MODEL", "METHOD", "PLAN", "ENVIRONMENT", "WARMED", "EAGER", "FAILED", "LAST",
                                "WARMED"]
    assert table[2].split()[:7] == ["examples/tiny-qwen3", "sft", "aaaa11112222", environment_key(ENVIRONMENT), "2",
                                    "0", "1"]


def test_eager_shapes_are_listed_as_eager_never_as_warmed(tmp_path: Path) -> None:
    """An eager warm-up ran its shapes and cached nothing: `ls` counts them under EAGER, `export` says the archive
    warms nothing, in its summary and a warning line."""
    cache = _warmed_cache(tmp_path / "cache", shapes=())
    manifest, key = Manifest(cache / MANIFEST), environment_key(ENVIRONMENT)
    for task in ("train 2x128", "train 2x256"):
        manifest.record(ManifestEntry(key, task, "eager", 1.0, plan="cccc55556666", warmed_at=time.time()),
                        ENVIRONMENT)
    (listed,) = scan_cache_dir(cache).plans
    assert (listed.warmed, listed.eager, listed.failed) == (0, 2, 0)
    assert json.loads(ok(console("cache", "ls", "--cache-dir", cache, "--json")))["cache_dirs"][0]["plans"][0][
        "eager"] == 2
    exported = console("cache", "export", "--cache-dir", cache, "-o", tmp_path / "a.tar.gz")
    assert exported.returncode == 0 and exported.stdout.startswith("exported 0 warmed shape(s) (nothing compiled)")
    assert "compiled with" not in exported.stdout
    (warning,) = exported.stderr.strip().splitlines()
    assert warning.startswith("warning: ") and "holds no compiled shape" in warning and "--torch_compile" in warning


def test_prune_a_plan_dry_run_then_for_real_keeps_files_the_rest_may_share(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "cache")
    before = _tree(cache)
    dry = json.loads(ok(console("cache", "prune", "--cache-dir", cache, "--plan", "bbbb", "--dry-run", "--json")))
    assert [e[2] for e in dry["entries"]] == ["train 4x512"] and dry["kept"] == 2
    assert _tree(cache) == before
    ok(console("cache", "prune", "--cache-dir", cache, "--plan", "bbbb"))
    (section,) = read_merged(cache).environments.values()
    assert sorted(section["shapes"]) == ["eval 2x64 per_pass=1", "train 2x128", "train 2x256"]
    assert {n: d for n, d in _tree(cache).items() if n != MANIFEST} == \
        {n: d for n, d in before.items() if n != MANIFEST}


def test_prune_older_than_everything_removes_the_compiled_files_too(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "cache")
    ok(console("cache", "prune", "--cache-dir", cache, "--older-than", "30d"))
    assert [p.plan for p in scan_cache_dir(cache).plans] == ["aaaa11112222"]
    out = ok(console("cache", "prune", "--cache-dir", cache, "--older-than", "10m"))
    assert "removed 3 shape(s) and 2 file(s)" in out
    assert {n for n in _tree(cache) if not n.endswith(".lock")} == {MANIFEST}
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []  # their emptied folders too
    assert console("cache", "prune", "--cache-dir", cache).returncode == 2  # neither --plan nor --older-than


def test_prune_clears_failed_shapes_and_the_lock_files_no_process_holds(tmp_path: Path) -> None:
    import fcntl
    import os

    cache = _cache(tmp_path / "cache")
    (cache / "locks").mkdir()
    held, stale = cache / "locks" / "held.lock", cache / "locks" / "0123abcd.lock"
    held.touch()
    stale.touch()  # left by a compile that was killed
    fd = os.open(held, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a compile in progress
    try:
        info = scan_cache_dir(cache)
        assert info.locks >= 2 and info.stale_locks == info.locks - 1
        out = ok(console("cache", "prune", "--cache-dir", cache, "--failed", "--stale-locks"))
        assert "removed 1 shape(s) and 0 file(s)" in out and f"removed {info.locks - 1} stale lock file(s)" in out
        assert held.exists() and not stale.exists()
    finally:
        os.close(fd)
    (section,) = read_merged(cache).environments.values()
    assert sorted(section["shapes"]) == ["train 2x128", "train 2x256", "train 4x512"]


def test_inspect_shows_an_archive_like_ls_shows_a_cache_dir(tmp_path: Path) -> None:
    cache, archive = _cache(tmp_path / "cache"), tmp_path / "cache.tar.gz"
    ok(console("cache", "export", "--cache-dir", cache, "-o", archive))
    shown = ok(console("cache", "inspect", archive)).splitlines()
    ls = ok(console("cache", "ls", "--cache-dir", cache)).splitlines()
    assert shown[1:4] == ls[1:4]  # the header and the two plans' rows
    assert shown[4].split()[0] == "versions:" and shown[5].split()[0] == "compiler:"
