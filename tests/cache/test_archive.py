"""`shapeplan cache export/import`: a round trip restores the cache byte for byte (and, after a real torch.compile
warm-up, `verify` in the imported dir compiles nothing); damaged, tampered, escaping or mismatched archives are
refused with one line, leaving nothing behind."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import pytest

from shapeplan.cache.archive import ARCHIVE_META, read_info
from shapeplan.cache.contents import IMPORT_MARKER, STAGING_PREFIX
from shapeplan.cli import main
from shapeplan.testing import FakeNeuron
from shapeplan.warm.manifest import MANIFEST, Manifest, environment_key, machine_environment
from shapeplan.warm.model import ManifestEntry
from tests import console
from tests.conftest import CAPYBARA, ROOT, WarmedSFT

FILES = {"fxgraph/ab/graph.bin": b"\x00compiled\x01" * 50, "aotautograd/cd/entry": b"autograd entry"}


def _warmed_cache(cache: Path, environment: dict | None = None, shapes: tuple[str, ...] = ("train 2x128",)) -> Path:
    """A cache dir as a warm-up leaves it: compiled files and a manifest recording `shapes` in `environment`."""
    environment = environment or {"method": "sft", **machine_environment("cpu")}
    for name, data in FILES.items():
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(data)
    manifest = Manifest(cache / MANIFEST)
    for shape in shapes:
        manifest.record(ManifestEntry(environment_key(environment), shape, "compiled", 1.0), environment)
    return cache


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _error(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def _export(cache: Path, archive: Path) -> None:
    assert main(["cache", "export", "--cache-dir", str(cache), "-o", str(archive)]) == 0


def _modes(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_mode & 0o777 for p in folder.rglob("*") if p.is_file()}


def test_round_trip_restores_every_file_and_its_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = _warmed_cache(tmp_path / "cache")
    (cache / f"{MANIFEST}.lock").write_text("")  # the manifest's lock file is not part of the cache
    (cache / "fxgraph/ab/graph.bin").chmod(0o755)  # a compiled .so keeps its exec bit
    (cache / "aotautograd/cd/entry").chmod(0o640)
    archive = tmp_path / "images" / "cache.tar.gz"
    _export(cache, archive)
    capsys.readouterr()
    imported = tmp_path / "imported"
    assert main(["cache", "import", str(archive), "--cache-dir", str(imported), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {"archive": str(archive), "environment": machine_environment("cpu"), "files": 3, "shapes": 1}
    expected = _tree(cache)
    del expected[f"{MANIFEST}.lock"]
    got = _tree(imported)
    assert set(got) - set(expected) == {IMPORT_MARKER}  # no staging left
    assert {name: got[name] for name in expected} == expected
    modes = _modes(imported)
    assert modes["fxgraph/ab/graph.bin"] == 0o755 and modes["aotautograd/cd/entry"] == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "images", "imported"]
    # the imported dir exports again, without the marker or the lock
    _export(imported, tmp_path / "again.tar.gz")
    assert read_info(tmp_path / "again.tar.gz").files == read_info(archive).files


def test_import_into_a_non_empty_dir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep").write_text("mine")
    capsys.readouterr()
    assert main(["cache", "import", str(tmp_path / "a.tar.gz"), "--cache-dir", str(target)]) == 1
    assert _error(capsys) == [f"Error: {target} is not an empty folder; import into a new or empty --cache-dir"]
    assert _tree(target) == {"keep": b"mine"}


def _rewrite(archive: Path, out: Path, *, change: Mapping[str, bytes] = MappingProxyType({}),
             add: Sequence[tarfile.TarInfo] = (), meta: dict | None = None) -> Path:
    """`archive` written again with some members' bytes changed, members added, or another metadata."""
    with tarfile.open(archive, "r:gz") as source, tarfile.open(out, "w:gz") as target:
        for member in source:
            data = source.extractfile(member).read() if member.isfile() else b""
            if member.name == ARCHIVE_META and meta is not None:
                data = json.dumps(meta).encode()
            data = change.get(member.name, data)
            member.size = len(data)
            target.addfile(member, io.BytesIO(data))
        for member in add:
            target.addfile(member, io.BytesIO(b"x" * member.size) if member.isfile() else None)
    return out


def _refused(archive: Path, target: Path, capsys: pytest.CaptureFixture[str], code: int = 1,
             options: tuple[str, ...] = ()) -> str:
    """The import's one error line; the target was not created."""
    capsys.readouterr()
    assert main(["cache", "import", str(archive), "--cache-dir", str(target), *options]) == code
    (line,) = _error(capsys)
    assert not target.exists()
    return line


def test_torchneuron_temporaries_are_neither_exported_nor_imported(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cache = _warmed_cache(tmp_path / "cache")
    (cache / "ab" / "cd").mkdir(parents=True)
    (cache / "ab" / "cd" / "abcd01.neff").write_bytes(b"neff")
    (cache / "ab" / "cd" / "abcd02.neff.tmp.Xy3_9q").write_bytes(b"half a neff")  # a compile in flight
    _export(cache, tmp_path / "a.tar.gz")
    with tarfile.open(tmp_path / "a.tar.gz", "r:gz") as tar:
        names = tar.getnames()
        meta = json.loads(tar.extractfile(ARCHIVE_META).read())
    assert "cache/ab/cd/abcd01.neff" in names and not any(".tmp." in name for name in names)
    assert not any(".tmp." in name for name in meta["files"])

    # an archive written before temporaries were left out: listed and packed, skipped on import
    stray = tarfile.TarInfo("cache/ab/cd/abcd03.neff.tmp.AbC123")
    stray.size = 4
    meta["files"]["ab/cd/abcd03.neff.tmp.AbC123"] = "0" * 64
    old = _rewrite(tmp_path / "a.tar.gz", tmp_path / "old.tar.gz", add=[stray], meta=meta)
    assert main(["cache", "import", str(old), "--cache-dir", str(tmp_path / "t")]) == 0
    assert sorted(p.name for p in (tmp_path / "t" / "ab" / "cd").iterdir()) == ["abcd01.neff"]


def test_tampered_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    bad = _rewrite(tmp_path / "a.tar.gz", tmp_path / "bad.tar.gz", change={"cache/aotautograd/cd/entry": b"evil!"})
    assert _refused(bad, tmp_path / "t", capsys) == \
        f"Error: {bad} is damaged: aotautograd/cd/entry does not match its checksum; export it again"


def test_added_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    extra = tarfile.TarInfo("cache/fxgraph/ab/extra.bin")
    extra.size = 3
    bad = _rewrite(tmp_path / "a.tar.gz", tmp_path / "bad.tar.gz", add=[extra])
    assert _refused(bad, tmp_path / "t", capsys) == \
        f"Error: {bad} is damaged: fxgraph/ab/extra.bin is not in its checksum list; export it again"


@pytest.mark.parametrize("name", ["cache/../escaped", "/tmp/escaped", "elsewhere/file"])
def test_member_outside_the_cache_is_refused(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    escaping = tarfile.TarInfo(name)
    escaping.size = 3
    bad = _rewrite(tmp_path / "a.tar.gz", tmp_path / "bad.tar.gz", add=[escaping])
    assert _refused(bad, tmp_path / "t", capsys) == f"Error: {bad} has a member outside the cache ({name}); refusing it"
    assert not (tmp_path / "escaped").exists()


def test_link_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    link = tarfile.TarInfo("cache/fxgraph/link")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    bad = _rewrite(tmp_path / "a.tar.gz", tmp_path / "bad.tar.gz", add=[link])
    assert _refused(bad, tmp_path / "t", capsys) == \
        f"Error: {bad} has a link or special file (cache/fxgraph/link); refusing it"


def test_other_package_versions_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    with tarfile.open(tmp_path / "a.tar.gz", "r:gz") as tar:
        meta = json.loads(tar.extractfile(ARCHIVE_META).read())
    here = meta["environment"]["versions"]["trl"]
    meta["environment"]["versions"]["trl"] = "1.15.0"
    bad = _rewrite(tmp_path / "a.tar.gz", tmp_path / "old.tar.gz", meta=meta)
    assert _refused(bad, tmp_path / "t", capsys, code=3) == \
        (f"Error: {bad} was compiled for another environment: trl=1.15.0 (this machine: {here}); warm this "
         "machine's own cache with `shapeplan warm` instead")


def test_other_neuron_compiler_flags_or_core_config_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    FakeNeuron().install(monkeypatch)
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type=transformer -O1")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    cache = _warmed_cache(tmp_path / "cache", {"method": "grpo", **machine_environment("neuron")})
    _export(cache, tmp_path / "neuron.tar.gz")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type=transformer -O2")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert _refused(tmp_path / "neuron.tar.gz", tmp_path / "t", capsys, code=3) == (
        f"Error: {tmp_path / 'neuron.tar.gz'} was compiled for another environment: NEURON_CC_FLAGS="
        "--model-type=transformer -O1 (this machine: --model-type=transformer -O2); NEURON_LOGICAL_NC_CONFIG=2 "
        "(this machine: 1); warm this machine's own cache with `shapeplan warm` instead")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type=transformer -O1")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert main(["cache", "import", str(tmp_path / "neuron.tar.gz"), "--cache-dir", str(tmp_path / "t")]) == 0


def test_neuron_archive_on_a_machine_without_torch_neuronx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with monkeypatch.context() as patched:
        FakeNeuron().install(patched)
        cache = _warmed_cache(tmp_path / "cache", {"method": "grpo", **machine_environment("neuron")})
        _export(cache, tmp_path / "neuron.tar.gz")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "torch_neuronx" else object())
    line = _refused(tmp_path / "neuron.tar.gz", tmp_path / "t", capsys, code=3)
    assert line.startswith("Error: this machine cannot use a neuron cache: --device neuron needs torch-neuronx")


def test_not_an_archive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "import", str(tmp_path / "missing.tar.gz"), "--cache-dir", str(tmp_path / "t")]) == 1
    assert _error(capsys) == [f"Error: archive {tmp_path / 'missing.tar.gz'} does not exist; pass a file written by "
                              "`shapeplan cache export`"]
    plain = tmp_path / "plain.tar.gz"
    with tarfile.open(plain, "w:gz") as tar:
        tar.add(CAPYBARA, arcname="data.jsonl")
    assert main(["cache", "import", str(plain), "--cache-dir", str(tmp_path / "t")]) == 1
    assert _error(capsys) == [f"Error: {plain} is not a shapeplan cache archive (no readable {ARCHIVE_META}); pass a "
                              "file written by `shapeplan cache export`"]


def test_export_needs_a_warmed_cache_of_one_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["cache", "export", "--cache-dir", str(empty), "-o", str(tmp_path / "a.tar.gz")]) == 1
    assert _error(capsys) == [f"Error: {empty.resolve()} has no {MANIFEST}; warm it with `shapeplan warm --cache-dir "
                              f"{empty.resolve()}` first"]
    cache = _warmed_cache(tmp_path / "cache")
    other = {"method": "sft", **machine_environment("cpu")}
    other["versions"] = {**other["versions"], "torch": "2.12.0"}
    _warmed_cache(cache, other)
    assert main(["cache", "export", "--cache-dir", str(cache), "-o", str(tmp_path / "a.tar.gz")]) == 1
    assert _error(capsys) == [f"Error: {cache.resolve()} holds shapes warmed with 2 different package versions or "
                              "compiler settings; export a cache dir warmed in one environment"]
    assert not (tmp_path / "a.tar.gz").exists()


@pytest.mark.slow
def test_imported_torch_compile_cache_compiles_nothing(warmed_sft: WarmedSFT, tmp_path: Path) -> None:
    """A real warm-up (torch.compile, Inductor's FX-graph and AOTAutograd caches), exported and imported into an
    empty dir: `verify` there hits every graph and misses none."""
    def shapeplan(*args: str) -> subprocess.CompletedProcess[str]:
        return console.run(args)

    plan, warmed_dir, imported_dir = warmed_sft.plan, warmed_sft.cache, tmp_path / "imported"
    (result,) = warmed_sft.report["results"]
    assert result["status"] == "compiled" and result["counters"]["fxgraph_cache_miss"] > 0

    archive = tmp_path / "cache.tar.gz"
    exported = shapeplan("cache", "export", "--cache-dir", str(warmed_dir), "-o", str(archive))
    assert exported.returncode == 0, exported.stderr
    imported = shapeplan("cache", "import", str(archive), "--cache-dir", str(imported_dir))
    assert imported.returncode == 0, imported.stderr

    verified = shapeplan("verify", "--plan", str(plan), "--device", "cpu", "--cache-dir", str(imported_dir), "--json")
    assert verified.returncode == 0, verified.stderr[-3000:]
    (check,) = json.loads(verified.stdout)["results"]
    assert check["status"] == "cached"
    assert check["counters"]["fxgraph_cache_hit"] == result["counters"]["fxgraph_cache_miss"]
    assert check["counters"]["autograd_cache_hit"] == result["counters"]["autograd_cache_miss"]
    assert "fxgraph_cache_miss" not in check["counters"] and "autograd_cache_miss" not in check["counters"]


def _forge(archive: Path, out: Path, *, files: dict[str, bytes | None], meta_pad: int = 0,
           expanded: int | None = None) -> Path:
    """`archive` with the cache files in `files` replaced (None: dropped) and its metadata made to match them, as a
    tamperer who recomputes the checksums would; `expanded` overrides the declared total."""
    import hashlib

    with tarfile.open(archive, "r:gz") as source:
        meta = json.loads(source.extractfile(ARCHIVE_META).read())
        members = [(m, source.extractfile(m).read() if m.isfile() else b"") for m in source]
    data = {m.name.removeprefix("cache/"): d for m, d in members if m.isfile() and m.name != ARCHIVE_META}
    for name, value in files.items():
        if value is None:
            data.pop(name, None)
        else:
            data[name] = value
    meta["files"] = {name: hashlib.sha256(d).hexdigest() for name, d in data.items()}
    meta["expanded"] = sum(len(d) for d in data.values()) if expanded is None else expanded
    with tarfile.open(out, "w:gz") as target:
        encoded = json.dumps(meta).encode() + b" " * meta_pad
        entry = tarfile.TarInfo(ARCHIVE_META)
        entry.size = len(encoded)
        target.addfile(entry, io.BytesIO(encoded))
        for name, d in data.items():
            entry = tarfile.TarInfo(f"cache/{name}")
            entry.size, entry.mode = len(d), 0o644
            target.addfile(entry, io.BytesIO(d))
    return out


def _two_environments(cache: Path) -> bytes:
    other = {"method": "sft", **machine_environment("cpu")}
    other["versions"] = {**other["versions"], "torch": "2.12.0"}
    manifest = Manifest(cache / MANIFEST)
    manifest.record(ManifestEntry(environment_key(other), "train 2x128", "compiled", 1.0), other)
    return (cache / MANIFEST).read_bytes()


@pytest.mark.parametrize("case", ["missing", "bad JSON", "not UTF-8", "two environments", "wrong structure"])
@pytest.mark.parametrize("existing", [False, True])
def test_unusable_manifest_leaves_the_target_as_it_was(case: str, existing: bool, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The files pass their checksums, but the manifest does not: the target stays absent, or empty."""
    cache = _warmed_cache(tmp_path / "cache")
    _export(cache, tmp_path / "a.tar.gz")
    manifest = {"missing": None, "bad JSON": b'{"schema": 1, "environ', "not UTF-8": b'{"schema": 1, "x": "\xff"}',
                "two environments": _two_environments(cache),
                "wrong structure": b'{"schema": 1, "environments": []}'}[case]
    bad = _forge(tmp_path / "a.tar.gz", tmp_path / "bad.tar.gz", files={MANIFEST: manifest})
    target = tmp_path / "t"
    if existing:
        target.mkdir()
        assert main(["cache", "import", str(bad), "--cache-dir", str(target)]) == 1
        (line,) = _error(capsys)
        assert list(target.iterdir()) == []
    else:
        line = _refused(bad, target, capsys)
    assert line == (f"Error: {bad} is damaged: its {MANIFEST} is missing, unreadable or holds several "
                    "environments; export it again")


@pytest.mark.parametrize("meta", [b'{"schema": 2, "x": "\xff"}', b'[1, 2]',
                                  b'{"schema": 2, "environment": [], "files": {}, "expanded": 0}',
                                  b'{"schema": 2, "environment": {"versions": {}, "compiler": "O2"}, "files": {}, '
                                  b'"expanded": 0}',
                                  b'{"schema": 2, "environment": {"versions": {}, "compiler": {}}, "files": {}, '
                                  b'"expanded": -1}'])
def test_malformed_archive_metadata_is_one_line(meta: bytes, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    bad = _rewrite(tmp_path / "a.tar.gz", tmp_path / "bad.tar.gz", change={ARCHIVE_META: meta})
    line = _refused(bad, tmp_path / "t", capsys)
    assert line.startswith(f"Error: {bad} ") and ("not a shapeplan cache archive" in line or "malformed" in line)
    assert main(["cache", "inspect", str(bad)]) == 1
    assert len(_error(capsys)) == 1


def test_import_onto_a_mount_point_never_renames_onto_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A mount point cannot be renamed (EBUSY): the import moves the staged contents into it instead."""
    import errno

    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    mount = tmp_path / "volume"
    mount.mkdir()
    real_rename = os.rename

    def rename(source: object, destination: object) -> None:
        if Path(str(source)).resolve() == mount.resolve() or Path(str(destination)).resolve() == mount.resolve():
            raise OSError(errno.EBUSY, "Device or resource busy")
        real_rename(source, destination)

    monkeypatch.setattr(os, "rename", rename)
    assert main(["cache", "import", str(tmp_path / "a.tar.gz"), "--cache-dir", str(mount)]) == 0
    assert _tree(mount)["fxgraph/ab/graph.bin"] == FILES["fxgraph/ab/graph.bin"]


def test_import_into_an_empty_tmpfs_mount_point(tmp_path: Path) -> None:
    mount = tmp_path / "volume"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mount / "lost+found").mkdir()  # as on a freshly formatted ext4 volume
        _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
        done = _console("cache", "import", str(tmp_path / "a.tar.gz"), "--cache-dir", str(mount))
        assert done.returncode == 0, done.stderr
        assert _tree(mount)["fxgraph/ab/graph.bin"] == FILES["fxgraph/ab/graph.bin"]
        assert (mount / IMPORT_MARKER).is_file() and not list(mount.glob(f"{STAGING_PREFIX}*"))
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _console(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, with this checkout's code."""
    return console.run(args, cwd=Path.cwd(), timeout=300)


def test_racing_imports_one_wins_the_other_gets_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import fcntl

    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    target = tmp_path / "t"
    target.mkdir()
    fd = os.open(target, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # an import holding the target right now
    try:
        assert main(["cache", "import", str(tmp_path / "a.tar.gz"), "--cache-dir", str(target)]) == 1
        assert _error(capsys) == [f"Error: another `shapeplan cache import` is filling {target.resolve()}; wait for "
                                  "it to finish"]
    finally:
        os.close(fd)
    assert list(target.iterdir()) == []
    # and two real processes started together: one imports, the other says why not in one line
    argv = [str(Path(sys.executable).parent / "shapeplan"), "cache", "import", str(tmp_path / "a.tar.gz"),
            "--cache-dir", str(tmp_path / "raced")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    racers = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    results = sorted((r.wait(timeout=300), r.stderr.read()) for r in racers)
    assert [code for code, _ in results] == [0, 1]
    (line,) = results[1][1].splitlines()
    assert line.startswith("Error: ") and ("another `shapeplan cache import`" in line or "not an empty folder" in line)
    assert _tree(tmp_path / "raced")["aotautograd/cd/entry"] == FILES["aotautograd/cd/entry"]


def test_symlinked_target_needs_follow_symlink(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    assert main(["cache", "import", str(tmp_path / "a.tar.gz"), "--cache-dir", str(link)]) == 1
    assert _error(capsys) == [f"Error: {link} is a symbolic link (to {real}); pass --follow-symlink to import "
                              "through it, or a real folder as --cache-dir"]
    assert list(real.iterdir()) == []
    assert main(["cache", "import", str(tmp_path / "a.tar.gz"), "--cache-dir", str(link), "--follow-symlink"]) == 0
    assert (real / "fxgraph/ab/graph.bin").read_bytes() == FILES["fxgraph/ab/graph.bin"]


def test_size_bomb_is_refused_before_extracting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """8 MiB of zeros compress to a few KiB: the declared total is checked against the limit before writing."""
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    bomb = _forge(tmp_path / "a.tar.gz", tmp_path / "bomb.tar.gz", files={"zeros": bytes(8 << 20)})
    assert bomb.stat().st_size < 64 << 10
    limit = ("--max-gib", str(1 / 1024))  # 1 MiB
    assert _refused(bomb, tmp_path / "t", capsys, options=limit) == \
        (f"Error: {bomb} expands to {(8 << 20) + sum(map(len, FILES.values())) + _manifest_size(tmp_path)} bytes, "
         f"over the limit of {1 << 20}; raise --max-gib if it is genuine")
    # an archive that under-declares its total is stopped at the member that exceeds it: nothing of it is written
    liar = _forge(tmp_path / "a.tar.gz", tmp_path / "liar.tar.gz", files={"zeros": bytes(8 << 20)}, expanded=4096)
    assert _refused(liar, tmp_path / "t", capsys, options=limit) == \
        f"Error: {liar} is damaged: its files expand beyond the 4096 bytes it declares; export it again"


def _manifest_size(tmp_path: Path) -> int:
    return (tmp_path / "cache" / MANIFEST).stat().st_size


def test_metadata_and_header_bombs_are_refused_before_reading_them(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    padded = _forge(tmp_path / "a.tar.gz", tmp_path / "meta.tar.gz", files={}, meta_pad=2 << 20)
    line = _refused(padded, tmp_path / "t", capsys, options=("--max-metadata-mib", "1"))
    assert line.startswith(f"Error: {padded} has a ") and line.endswith(
        f"-byte {ARCHIVE_META}, over the {1 << 20}-byte limit; raise --max-metadata-mib if it is genuine")
    # a 4 MiB pax header (tarfile would read it whole into memory)
    pax = tarfile.TarInfo("cache/x")
    pax.pax_headers = {"comment": "x" * (4 << 20)}
    with tarfile.open(tmp_path / "a.tar.gz", "r:gz") as source, \
            tarfile.open(tmp_path / "pax.tar.gz", "w:gz", format=tarfile.PAX_FORMAT) as out:
        for member in source:
            out.addfile(member, source.extractfile(member) if member.isfile() else None)
        out.addfile(pax, io.BytesIO(b""))
    line = _refused(tmp_path / "pax.tar.gz", tmp_path / "t", capsys)
    assert line.startswith(f"Error: {tmp_path / 'pax.tar.gz'} is damaged (") and "extended header" in line


def test_truncated_gzip_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes((tmp_path / "a.tar.gz").read_bytes()[:-10])
    line = _refused(cut, tmp_path / "t", capsys)
    assert line.startswith(f"Error: {cut} is damaged (") and line.endswith("; export it again")


def test_killed_import_is_refused_by_warm_and_cleared_by_the_next_import(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """kill -9 after the staged files were moved in, before the completion marker: `warm` refuses the dir, the
    next import clears it and imports."""
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    target = tmp_path / "t"
    killer = ("import os, sys; import shapeplan.cache.archive_import as a\n"
              "def killed(*args, **kwargs): os.kill(os.getpid(), 9)\n"
              "a.write_atomic = killed\n"
              "from shapeplan.cli import main; sys.exit(main(sys.argv[1:]))")
    killed = subprocess.run([sys.executable, "-c", killer, "cache", "import", str(tmp_path / "a.tar.gz"),
                             "--cache-dir", str(target)], env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert killed.returncode == -9
    assert (target / "fxgraph/ab/graph.bin").exists() and list(target.glob(f"{STAGING_PREFIX}*"))
    assert not (target / IMPORT_MARKER).exists()
    capsys.readouterr()
    assert main(["warm", "--plan", str(tmp_path / "plan.json"), "--device", "cpu", "--cache-dir", str(target)]) == 1
    assert _error(capsys) == [f"Error: {target} holds an unfinished `shapeplan cache import` (running, or killed); "
                              "wait for it, or run the import again, which clears it"]
    assert main(["cache", "import", str(tmp_path / "a.tar.gz"), "--cache-dir", str(target)]) == 0
    assert (target / IMPORT_MARKER).is_file() and not list(target.glob(f"{STAGING_PREFIX}*"))
    assert _tree(target)["fxgraph/ab/graph.bin"] == FILES["fxgraph/ab/graph.bin"]
    # a second import into the complete one is refused and changes nothing
    before = _tree(target)
    assert main(["cache", "import", str(tmp_path / "a.tar.gz"), "--cache-dir", str(target)]) == 1
    assert _tree(target) == before


def test_target_whose_parent_is_read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    if os.access(parent, os.W_OK):  # root writes anyway: make the folder behave as read-only
        def refuse(self: Path, *args: object, **kwargs: object) -> None:
            raise PermissionError(13, "Permission denied", str(self))

        monkeypatch.setattr(Path, "mkdir", refuse)
    assert main(["cache", "import", str(tmp_path / "a.tar.gz"), "--cache-dir", str(parent / "t")]) == 1
    assert _error(capsys) == [f"Error: cannot create {parent / 't'} (Permission denied); import into a writable "
                              "--cache-dir"]
    assert list(parent.iterdir()) == []


def test_export_killed_midway_leaves_a_partial_the_next_export_removes(tmp_path: Path) -> None:
    cache = _warmed_cache(tmp_path / "cache")
    out = tmp_path / "out"
    killer = ("import os, sys, tarfile\n"
              "def killed(*args, **kwargs): os.kill(os.getpid(), 9)\n"
              "tarfile.TarFile.addfile = killed\n"
              "from shapeplan.cli import main; sys.exit(main(sys.argv[1:]))")
    argv = ["cache", "export", "--cache-dir", str(cache), "-o", str(out / "a.tar.gz")]
    killed = subprocess.run([sys.executable, "-c", killer, *argv], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            timeout=300)
    assert killed.returncode == -9
    assert next(p.name for p in out.iterdir()).startswith(".a.tar.gz.")  # the killed export's partial
    previous = os.umask(0o022)
    try:
        assert main(argv) == 0
    finally:
        os.umask(previous)
    assert [p.name for p in out.iterdir()] == ["a.tar.gz"]
    assert (out / "a.tar.gz").stat().st_mode & 0o777 == 0o644


def test_a_failure_while_moving_in_takes_back_what_was_moved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    target = tmp_path / "t"
    target.mkdir()
    real_rename, calls = os.rename, []

    def rename(source: object, destination: object) -> None:
        calls.append(destination)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        real_rename(source, destination)

    monkeypatch.setattr(os, "rename", rename)
    assert main(["cache", "import", str(tmp_path / "a.tar.gz"), "--cache-dir", str(target)]) == 1
    assert _error(capsys) == [f"Error: cannot finish the import into {target} (Input/output error); nothing was "
                              "imported, check the folder and import again"]
    assert list(target.iterdir()) == []


def test_not_enough_free_space_is_refused_before_extracting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    _export(_warmed_cache(tmp_path / "cache"), tmp_path / "a.tar.gz")
    expanded = read_info(tmp_path / "a.tar.gz").expanded
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 100))
    assert _refused(tmp_path / "a.tar.gz", tmp_path / "t", capsys) == \
        (f"Error: {tmp_path / 't'} has 100 bytes free, {tmp_path / 'a.tar.gz'} needs {expanded}; free space or "
         "import elsewhere")
