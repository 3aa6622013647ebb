"""The precompute warm-up's pass datasets (`shared_datasets`): written once into the datasets cache, where a real
run's precompute result lives too, and cleaned up by this host only."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from shapeplan.warm.preference import shared_datasets


def test_pass_datasets_live_in_the_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    prefix = f"shapeplan-precompute-{socket.gethostname()}-"
    dead = tmp_path / f"{prefix}999999999-stale"  # a pid no process has
    other_host = tmp_path / "shapeplan-precompute-otherhost-999999999-live"
    dead.mkdir()
    other_host.mkdir()
    loaded = shared_datasets([[{"a": 1}, {"a": 2}], [{"a": 3}]])
    assert [d["a"] for d in loaded] == [[1, 2], [3]]
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith(prefix)]
    assert all(Path(f["filename"]).is_relative_to(folder) for d in loaded for f in d.cache_files)
    assert not dead.exists() and other_host.exists()  # this host's dead warm-up's folder only
