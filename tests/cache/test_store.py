"""`shapeplan cache push|pull|ls URL` against a real S3 server on loopback (moto's standalone server), through the
client a user runs (s3fs, configured by AWS_ENDPOINT_URL and the AWS credential variables): the round trip, the
incremental pull and push (objects counted in the server's request log), a pull killed with kill -9, concurrent
pushes, a tampered object, another environment, a missing bucket, no credentials; and a real torch.compile
warm-up pushed, pulled on a fresh dir and verified."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shapeplan.cache.contents import PULL_STAGING
from shapeplan.cli import main
from shapeplan.warm.manifest import MANIFEST, machine_environment, read_merged
from tests.cache.s3_server import S3Server, s3_server
from tests.cache.test_archive import FILES, _tree, _warmed_cache
from tests.cli.test_exit_codes import SHAPEPLAN, ok
from tests.conftest import CAPYBARA, ROOT
from tests.console import run as run_console
from tests.warm.harness import run_argv

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(tmp_path_factory.mktemp("moto")) as running:
        yield running


@pytest.fixture
def url(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new bucket on the server, and the environment a user of it sets."""
    import s3fs

    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    bucket = f"b{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    return f"s3://{bucket}/shapeplan"


def console(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_console(args, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=600)


def refused_with(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The one error line of a refusal with `code`: nothing on stdout, no traceback."""
    assert (result.returncode, result.stdout) == (code, ""), result.stderr[-3000:]
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ")
    return line


def _cache_files(folder: Path) -> dict[str, bytes]:
    """The compiled files of a cache dir (its manifest is rewritten by a pull, its staging is not content)."""
    return {name: data for name, data in _tree(folder).items()
            if name != MANIFEST and not name.startswith(PULL_STAGING) and not name.endswith(".lock")}


def _bigger_cache(cache: Path, files: int, size: int, shapes: tuple[str, ...] = ("train 2x128",)) -> Path:
    _warmed_cache(cache, shapes=shapes)
    for index in range(files):
        path = cache / "fxgraph" / f"{index % 7:02d}" / f"entry-{cache.name}-{index}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    return cache


def test_push_then_pull_restores_every_file_mode_and_shape(url: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    cache = _warmed_cache(tmp_path / "cache", shapes=("train 2x128", "eval 2x64 per_pass=1"))
    (cache / "fxgraph/ab/graph.bin").chmod(0o755)
    assert main(["cache", "push", "--cache-dir", str(cache), url, "--json"]) == 0
    pushed = json.loads(capsys.readouterr().out)
    assert (pushed["files"], pushed["shapes"], pushed["uploaded_objects"]) == (len(FILES), 2, len(FILES))

    fresh = tmp_path / "fresh" / "cache"
    assert main(["cache", "pull", url, "--cache-dir", str(fresh), "--json"]) == 0
    pulled = json.loads(capsys.readouterr().out)
    assert (pulled["downloaded_objects"], pulled["present"], pulled["shapes"]) == (len(FILES), 0, 2)
    assert _cache_files(fresh) == _cache_files(cache)
    assert (fresh / "fxgraph/ab/graph.bin").stat().st_mode & 0o777 == 0o755
    (section,) = read_merged(fresh).environments.values()
    assert sorted(section["shapes"]) == ["eval 2x64 per_pass=1", "train 2x128"]
    assert not list(fresh.glob(f"{PULL_STAGING}*"))


def test_second_pull_downloads_only_manifests_and_push_uploads_only_what_is_new(
        url: str, server: S3Server, tmp_path: Path) -> None:
    cache = _bigger_cache(tmp_path / "cache", files=20, size=2000)
    assert main(["cache", "push", "--cache-dir", str(cache), url]) == 0
    fresh = tmp_path / "fresh"
    assert main(["cache", "pull", url, "--cache-dir", str(fresh)]) == 0

    mark = server.mark()
    assert main(["cache", "pull", url, "--cache-dir", str(fresh)]) == 0
    assert server.object_requests(mark, "GET") == []  # only the listing and the manifest

    mark = server.mark()
    assert main(["cache", "push", "--cache-dir", str(cache), url]) == 0
    assert server.object_requests(mark, "PUT") == []  # the store holds every file already

    (cache / "fxgraph" / "new-entry").write_bytes(b"compiled later")
    mark = server.mark()
    assert main(["cache", "push", "--cache-dir", str(cache), url]) == 0
    assert len(server.object_requests(mark, "PUT")) == 1
    mark = server.mark()
    assert main(["cache", "pull", url, "--cache-dir", str(fresh)]) == 0
    assert len(server.object_requests(mark, "GET")) == 1
    assert _cache_files(fresh) == _cache_files(cache)


def test_pull_killed_mid_download_leaves_the_cache_as_it_was_and_a_rerun_completes(
        url: str, tmp_path: Path) -> None:
    source = _bigger_cache(tmp_path / "source", files=400, size=20_000)
    assert main(["cache", "push", "--cache-dir", str(source), url]) == 0
    target = _warmed_cache(tmp_path / "target", shapes=("train 4x256",))
    before, before_files = _tree(target), _cache_files(target)
    process = subprocess.Popen([SHAPEPLAN, "cache", "pull", url, "--cache-dir", str(target)], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(p.is_file() for p in target.glob(f"{PULL_STAGING}*/*")):  # downloading
        assert process.poll() is None and time.monotonic() < deadline, "the pull ended before it was killed"
        time.sleep(0.002)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert {n: d for n, d in _tree(target).items() if not n.startswith(PULL_STAGING)} == before
    ok(console("cache", "export", "--cache-dir", target, "-o", tmp_path / "a.tar.gz"))  # not refused: as it was

    assert main(["cache", "pull", url, "--cache-dir", str(target)]) == 0
    assert _cache_files(target) == {**before_files, **_cache_files(source)}
    assert sorted(read_merged(target).environments.popitem()[1]["shapes"]) == ["train 2x128", "train 4x256"]
    assert not list(target.glob(f"{PULL_STAGING}*"))


def test_concurrent_pushes_of_fleet_shards_lose_nothing(url: str, tmp_path: Path) -> None:
    shards = [_bigger_cache(tmp_path / f"shard{i}", files=30, size=3000, shapes=(f"train {i + 1}x128",))
              for i in range(2)]
    pushes = [subprocess.Popen([SHAPEPLAN, "cache", "push", "--cache-dir", str(shard), url], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for shard in shards]
    for push in pushes:
        _, err = push.communicate(timeout=300)
        assert push.returncode == 0, err
    fresh = tmp_path / "fresh"
    ok(console("cache", "pull", url, "--cache-dir", fresh))
    assert _cache_files(fresh) == {**_cache_files(shards[0]), **_cache_files(shards[1])}
    (section,) = read_merged(fresh).environments.values()
    assert sorted(section["shapes"]) == ["train 1x128", "train 2x128"]
    listing = ok(console("cache", "ls", url, "--json"))
    assert len(json.loads(listing)["pushes"]) == 2


def test_tampered_object_is_refused_and_nothing_is_written(url: str, tmp_path: Path) -> None:
    import hashlib

    import s3fs

    cache = _warmed_cache(tmp_path / "cache")
    assert main(["cache", "push", "--cache-dir", str(cache), url]) == 0
    digest = hashlib.sha256(FILES["fxgraph/ab/graph.bin"]).hexdigest()
    s3fs.S3FileSystem(skip_instance_cache=True).pipe(f"{url.removeprefix('s3://')}/objects/{digest}", b"evil")
    fresh, existing = tmp_path / "fresh", _warmed_cache(tmp_path / "existing", shapes=("train 4x256",))
    (existing / "fxgraph/ab/graph.bin").unlink()  # the file the pull needs
    before = _tree(existing)
    line = refused_with(console("cache", "pull", url, "--cache-dir", fresh), 1)
    assert f"objects/{digest} does not match its checksum" in line
    assert not fresh.exists()
    refused_with(console("cache", "pull", url, "--cache-dir", existing), 1)
    assert _tree(existing) == before


def test_store_of_another_environment_is_refused_with_exit_3(url: str, tmp_path: Path) -> None:
    here = machine_environment("cpu")
    other = {"method": "sft", **here, "versions": {**here["versions"], "torch": "0.0.1"}}
    assert main(["cache", "push", "--cache-dir", str(_warmed_cache(tmp_path / "cache", other)), url]) == 0
    line = refused_with(console("cache", "pull", url, "--cache-dir", tmp_path / "fresh"), 3)
    assert "torch=0.0.1 (this machine: " in line
    assert not (tmp_path / "fresh").exists()


def test_missing_bucket_and_missing_credentials_are_one_line(url: str, tmp_path: Path) -> None:
    cache = _warmed_cache(tmp_path / "cache")
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/shapeplan"
    assert "no such bucket" in refused_with(console("cache", "push", "--cache-dir", cache, missing), 1)
    assert "no such bucket" in refused_with(console("cache", "pull", missing, "--cache-dir", tmp_path / "f"), 1)
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    result = subprocess.run([SHAPEPLAN, "cache", "push", "--cache-dir", str(cache), url], cwd=ROOT, text=True,
                            capture_output=True, env={**env, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)},
                            timeout=300, check=False)
    assert "no credentials found" in refused_with(result, 1)
    assert not (tmp_path / "f").exists()


def test_pull_plan_downloads_only_the_pushes_holding_its_shapes(url: str, server: S3Server, tmp_path: Path) -> None:
    from shapeplan.plan.io import write_plan
    from shapeplan.services.run import plan_tasks
    from tests.warm.harness import plan_for

    plan = tmp_path / "plan.json"
    write_plan(plan_for("sft", CAPYBARA, ["--max_length", "128", "--per_device_train_batch_size", "2"],
                        tmp_path / "out"), plan)
    keys = tuple(t.key for t in plan_tasks(str(plan), "cpu"))
    mine = _bigger_cache(tmp_path / "mine", files=10, size=1000, shapes=keys)
    other = _bigger_cache(tmp_path / "other", files=10, size=1000, shapes=("train 64x4096",))
    for cache in (mine, other):
        assert main(["cache", "push", "--cache-dir", str(cache), url]) == 0
    mark = server.mark()
    fresh = tmp_path / "fresh"
    assert main(["cache", "pull", url, "--cache-dir", str(fresh), "--plan", str(plan)]) == 0
    assert len(server.object_requests(mark, "GET")) == len(_cache_files(mine))
    assert _cache_files(fresh) == _cache_files(mine)
    assert console("warm", "--plan", plan, "--status", "--cache-dir", fresh).returncode == 0
    status = console("warm", "--plan", plan, "--status", url, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["complete"]


def test_local_folder_store_round_trip(tmp_path: Path) -> None:
    cache = _warmed_cache(tmp_path / "cache")
    store = tmp_path / "store"
    ok(console("cache", "push", "--cache-dir", cache, f"file://{store}"))
    ok(console("cache", "pull", str(store), "--cache-dir", tmp_path / "fresh"))
    assert _cache_files(tmp_path / "fresh") == _cache_files(cache)
    assert not [p for p in store.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_pushed_torch_compile_cache_pulled_on_a_fresh_dir_compiles_nothing(url: str, tmp_path: Path) -> None:
    """A real warm-up (torch.compile, Inductor's FX-graph and AOTAutograd caches), pushed to S3 and pulled into an
    empty dir: `verify` there hits every graph and misses none."""
    from shapeplan.plan.io import load_plan
    from shapeplan.warm.runner import plan_id

    plan, warmed_dir, pulled_dir = tmp_path / "plan.json", tmp_path / "warmed", tmp_path / "pulled"
    argv = ["--max_length", "128", "--per_device_train_batch_size", "2", "--max_steps", "2", "--torch_compile", "true"]
    ok(console("analyze", *run_argv(CAPYBARA, argv, tmp_path / "out"), "-o", plan))
    warmed = json.loads(ok(console("warm", "--plan", plan, "--device", "cpu", "--cache-dir", warmed_dir,
                                   "--push", url, "--json")))
    (result,) = warmed["results"]
    assert result["status"] == "compiled" and result["counters"]["fxgraph_cache_miss"] > 0
    (listed,) = json.loads(ok(console("cache", "ls", "--cache-dir", warmed_dir, "--json")))["cache_dirs"][0]["plans"]
    assert (listed["plan"], listed["warmed"], listed["method"]) == (plan_id(load_plan(plan)), 1, "sft")
    ok(console("cache", "pull", url, "--cache-dir", pulled_dir))
    rewarmed = json.loads(ok(console("warm", "--plan", plan, "--device", "cpu", "--cache-dir", tmp_path / "again",
                                     "--pull", url, "--json")))
    assert [r["status"] for r in rewarmed["results"]] == ["skipped"]  # pulled first: nothing left to warm
    verified = json.loads(ok(console("verify", "--plan", plan, "--device", "cpu", "--cache-dir", pulled_dir,
                                     "--json")))
    (check,) = verified["results"]
    assert check["status"] == "cached"
    assert check["counters"]["fxgraph_cache_hit"] == result["counters"]["fxgraph_cache_miss"]
    assert "fxgraph_cache_miss" not in check["counters"] and "autograd_cache_miss" not in check["counters"]


def test_pull_killed_while_moving_files_in_is_refused_by_warm_and_finished_by_the_next_pull(
        url: str, tmp_path: Path) -> None:
    """What a pull killed after its journal leaves (every object staged and checked, the journal written, some
    files moved in): `export` (and `warm`, `verify`) refuse the dir; the next pull finishes the move."""
    import hashlib

    from shapeplan.cache.contents import PULL_JOURNAL

    source = _bigger_cache(tmp_path / "source", files=5, size=100)
    assert main(["cache", "push", "--cache-dir", str(source), url]) == 0
    target = tmp_path / "target"
    staging = target / f"{PULL_STAGING}999999-killed"
    staging.mkdir(parents=True)
    links = []
    for name, data in _cache_files(source).items():
        digest = hashlib.sha256(data).hexdigest()
        (staging / digest).write_bytes(data)
        links.append([digest, name, 0o644])
    (target / links[0][1]).parent.mkdir(parents=True)
    os.link(staging / links[0][0], target / links[0][1])  # the first file was moved in
    sections = {k: {"environment": s["environment"], "shapes": s["shapes"]}
                for k, s in read_merged(source).environments.items()}
    (staging / PULL_JOURNAL).write_text(json.dumps({"links": links, "sections": sections}))

    line = refused_with(console("cache", "export", "--cache-dir", target, "-o", tmp_path / "a.tar.gz"), 1)
    assert "unfinished `shapeplan cache pull`" in line
    assert main(["cache", "pull", url, "--cache-dir", str(target)]) == 0
    assert _cache_files(target) == _cache_files(source)
    assert not list(target.glob(f"{PULL_STAGING}*"))
    (section,) = read_merged(target).environments.values()
    assert sorted(section["shapes"]) == ["train 2x128"]
