"""`shapeplan cache merge`: the archives of a plan's shards joined into one (shard manifests side by side, shared
files once), checked file by file; parts of two environments (exit 3) or one path with two contents (exit 1)
write nothing."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from shapeplan.cache.archive import export_cache, merge_archives, read_info
from shapeplan.errors import CacheError, CacheMismatchError
from shapeplan.warm.manifest import Manifest, environment_key, machine_environment, manifest_name, read_merged
from shapeplan.warm.model import ManifestEntry
from shapeplan.warm.shards import Shard
from tests import console

SHARED = {"fxgraph/00/optimizer-step": b"the same graph every shard compiles"}


def _shard_cache(cache: Path, index: int, count: int, own: dict[str, bytes], shapes: tuple[str, ...],
                 environment: dict | None = None) -> Path:
    """A cache dir as shard `index` of `count` leaves it: its files and its own manifest file."""
    environment = environment or {"method": "sft", **machine_environment("cpu")}
    for name, data in {**SHARED, **own}.items():
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(data)
    manifest = Manifest(cache / manifest_name(Shard(index, count, "--shard")))
    for shape in shapes:
        manifest.record(ManifestEntry(environment_key(environment), shape, "compiled", 1.0), environment)
    return cache


def _parts(tmp_path: Path) -> list[Path]:
    parts = []
    for i, shapes in enumerate((("train 2x128",), ("train 2x256", "eval 2x128 per_pass=1"))):
        cache = _shard_cache(tmp_path / f"shard{i}", i, 2, {f"fxgraph/{i}{i}/graph": f"shard {i}".encode()}, shapes)
        parts.append(export_cache(cache, tmp_path / f"shard{i}.tar.gz").path)
    return [Path(p) for p in parts]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return console.run(["cache", *args], cwd=Path.cwd(), timeout=120)


def test_merge_joins_the_shards_and_imports_whole(tmp_path: Path) -> None:
    parts = _parts(tmp_path)
    out = tmp_path / "all.tar.gz"
    done = _cli("merge", *map(str, parts), "-o", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["shapes"] == 3
    info = read_info(out)
    assert set(info.files) == {"fxgraph/00/optimizer-step", "fxgraph/00/graph", "fxgraph/11/graph",
                               "shapeplan-manifest.0-of-2.json", "shapeplan-manifest.1-of-2.json"}
    imported = tmp_path / "imported"
    done = _cli("import", str(out), "--cache-dir", str(imported))
    assert done.returncode == 0, done.stderr
    assert (imported / "fxgraph/11/graph").read_bytes() == b"shard 1"
    merged = read_merged(imported)
    (section,) = merged.environments.values()
    assert {k: v["shard"] for k, v in section["shapes"].items()} == {
        "train 2x128": "0/2", "train 2x256": "1/2", "eval 2x128 per_pass=1": "1/2"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".shapeplan-merging-", ".all.tar.gz"))]


def test_same_path_with_other_contents_is_a_conflict_nothing_written(tmp_path: Path) -> None:
    parts = _parts(tmp_path)
    other = _shard_cache(tmp_path / "other", 0, 2, {"fxgraph/00/graph": b"another compile"}, ("train 4x128",))
    parts.append(Path(export_cache(other, tmp_path / "other.tar.gz").path))
    out = tmp_path / "all.tar.gz"
    done = _cli("merge", *map(str, parts), "-o", str(out))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "different contents for" in done.stderr, done.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_parts_of_two_environments_exit_3(tmp_path: Path) -> None:
    parts = _parts(tmp_path)
    environment = machine_environment("cpu")
    environment = {"method": "sft", **environment, "versions": {**environment["versions"], "torch": "0.0.1"}}
    odd = _shard_cache(tmp_path / "odd", 1, 3, {}, ("train 8x128",), environment=environment)
    parts.append(Path(export_cache(odd, tmp_path / "odd.tar.gz").path))
    done = _cli("merge", *map(str, parts), "-o", str(tmp_path / "all.tar.gz"))
    assert done.returncode == 3, done.stderr
    assert "torch=" in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "all.tar.gz").exists()


def test_a_tampered_part_is_refused(tmp_path: Path) -> None:
    parts = _parts(tmp_path)
    meta = read_info(parts[1])
    forged = tmp_path / "forged.tar.gz"
    with tarfile.open(parts[1]) as source, tarfile.open(forged, "w:gz") as target:
        for member in source.getmembers():
            handle = source.extractfile(member)
            data = handle.read() if handle is not None else None
            if member.name == "cache/fxgraph/11/graph":
                data = b"tampered"
                member.size = len(data)
            target.addfile(member, None if data is None else io.BytesIO(data))
    assert read_info(forged).files == meta.files
    with pytest.raises(CacheError, match="checksum"):
        merge_archives([parts[0], forged], tmp_path / "all.tar.gz")
    assert not (tmp_path / "all.tar.gz").exists()
    with pytest.raises(CacheMismatchError):
        environment = {"method": "sft", **machine_environment("cpu")}
        environment["compiler"] = {**environment["compiler"], "device": "neuron"}
        odd = _shard_cache(tmp_path / "odd", 0, 1, {}, ("train 8x128",), environment=environment)
        merge_archives([parts[0], Path(export_cache(odd, tmp_path / "odd.tar.gz").path)], tmp_path / "x.tar.gz")


def test_two_builds_of_one_native_source_are_one_entry(tmp_path: Path) -> None:
    """Inductor's `<hash>.main.so` is named after its `.cpp` source, and gcc does not rebuild it byte for byte: the
    same source with two builds keeps the first part's; another source under the name is still a conflict."""
    source = {"ab/cab.main.cpp": b"extern \"C\" void kernel() {}"}
    first = _shard_cache(tmp_path / "a", 0, 2, {**source, "ab/cab.main.so": b"\x7fELF build 1"}, ("train 2x128",))
    second = _shard_cache(tmp_path / "b", 1, 2, {**source, "ab/cab.main.so": b"\x7fELF build 2"}, ("train 2x256",))
    parts = [Path(export_cache(c, tmp_path / f"{c.name}.tar.gz").path) for c in (first, second)]
    merged = merge_archives(parts, tmp_path / "all.tar.gz")
    assert merged.files["ab/cab.main.so"] == read_info(parts[0]).files["ab/cab.main.so"]
    done = _cli("import", str(tmp_path / "all.tar.gz"), "--cache-dir", str(tmp_path / "imported"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "imported/ab/cab.main.so").read_bytes() == b"\x7fELF build 1"

    third = _shard_cache(tmp_path / "c", 1, 2, {"ab/cab.main.cpp": b"other source", "ab/cab.main.so": b"\x7fELF 3"},
                         ("train 4x256",))
    with pytest.raises(CacheError, match=r"different contents for ab/cab\.main"):
        merge_archives([parts[0], Path(export_cache(third, tmp_path / "c.tar.gz").path)], tmp_path / "x.tar.gz")
    assert not (tmp_path / "x.tar.gz").exists()
