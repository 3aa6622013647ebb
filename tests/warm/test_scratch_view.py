"""`scratch_view`, where `verify` compiles: a writable view of the cache dir (hard links, else copies, no lock
files), deleted afterwards; and the Neuron backend's lock dir inside it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from shapeplan.errors import CacheError
from shapeplan.testing import FakeNeuron
from shapeplan.warm.backends.neuron import NeuronBackend
from shapeplan.warm.cachedir import existing_cache_dir, scratch_view


def _cache(folder: Path) -> Path:
    (folder / "fxgraph" / "ab").mkdir(parents=True)
    (folder / "fxgraph" / "ab" / "graph.bin").write_bytes(b"compiled")
    (folder / "locks").mkdir()
    (folder / "locks" / "graph.lock").write_text("")
    (folder / "fxgraph").chmod(0o555)  # read-only folders, as a baked image may have them
    return folder


def test_view_links_the_files_and_is_writable_and_deleted(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "cache")
    try:
        with scratch_view(cache) as scratch:
            view = scratch / "cache"
            assert scratch.parent == tmp_path  # next to the cache: the same file system
            assert os.path.samefile(view / "fxgraph" / "ab" / "graph.bin", cache / "fxgraph" / "ab" / "graph.bin")
            assert not (view / "locks" / "graph.lock").exists()  # per-process state, not cache content
            assert (view / "fxgraph").stat().st_mode & stat.S_IWUSR
            (view / "fxgraph" / "new.bin").write_bytes(b"a compile")  # lands in the view only
        assert not scratch.exists()
        assert not (cache / "fxgraph" / "new.bin").exists()
    finally:
        (cache / "fxgraph").chmod(0o755)


def test_view_copies_where_files_cannot_be_linked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(tmp_path / "cache")

    def cross_device(source: str, target: str) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    try:
        with scratch_view(cache) as scratch:
            copy = scratch / "cache" / "fxgraph" / "ab" / "graph.bin"
            assert copy.read_bytes() == b"compiled"
            assert not os.path.samefile(copy, cache / "fxgraph" / "ab" / "graph.bin")
    finally:
        (cache / "fxgraph").chmod(0o755)


def test_verify_needs_an_existing_folder(tmp_path: Path) -> None:
    with pytest.raises(CacheError, match="does not exist"):
        existing_cache_dir(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(CacheError, match="is not a folder"):
        existing_cache_dir(tmp_path / "file")
    assert not (tmp_path / "missing").exists()


def test_neuron_lock_dir_goes_into_the_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNeuron().install(monkeypatch)
    monkeypatch.delenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", raising=False)  # restored after the test
    NeuronBackend().prepare(tmp_path / "cache")
    assert "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR" not in os.environ  # warm keeps TorchNeuron's local default
    NeuronBackend().prepare(tmp_path / "scratch" / "cache", scratch=tmp_path / "scratch")
    assert os.environ["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"] == str(tmp_path / "scratch" / "locks")
