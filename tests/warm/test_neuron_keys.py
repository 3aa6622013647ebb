"""TorchNeuron as Neuron 2.34 ships it (issue #56), against the strict fake with and without the cache-entry
bindings: the four-part versions a cache was warmed under, each shape's compile-cache keys and compile milliseconds,
what a compiler's exit code means, caches split per rank and cache or lock dirs on NFS. In-process, milliseconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shapeplan.adapters.host import installed_versions
from shapeplan.errors import CacheMismatchError, UnplannedShapeError
from shapeplan.plan.model import Plan, PlanStats, Shape
from shapeplan.testing import FakeNeuron, FakeWarmer, version_site
from shapeplan.warm import cachedir
from shapeplan.warm.backends import neuron
from shapeplan.warm.backends.neuron import NeuronBackend
from shapeplan.warm.manifest import MACHINE_PACKAGES, MANIFEST, mismatches, refuse_other_environment
from shapeplan.warm.runner import warm


def _plan(*seqs: int) -> Plan:
    shapes = tuple(Shape(phase="train", batch=2, seq=s, count=1, first_step=1) for s in seqs)
    return Plan(method="sft", exact=True, pad_to_multiple_of=128, shapes=shapes,
                stats=PlanStats(rows=4, dropped_rows=0, micro_batches=len(seqs), optimizer_steps=len(seqs),
                                tokens=1, padded_tokens=1))


def _warmer(meet: Any, **kwargs: Any) -> FakeWarmer:
    """A warmer whose environment holds the versions a real one records."""
    return FakeWarmer(meet, environment={"method": "sft", "model": "tiny",
                                         "versions": installed_versions(MACHINE_PACKAGES)}, **kwargs)


def _shapes(cache: Path) -> dict[str, dict[str, Any]]:
    (section,) = json.loads((cache / MANIFEST).read_text())["environments"].values()
    return dict(section["shapes"])


# What a warm-up of the fake records as its compiler environment (async mode, eager): part of every Neuron cache's
# manifest key since the first Neuron warm-up. A change here splits every existing Neuron cache dir.
NEURON_SETTINGS = {"backend", "device", "target", "torch", "torch-neuronx", "neuronx-cc", "NEURON_CC_FLAGS",
                   "NEURON_LOGICAL_NC_CONFIG", "NEURON_COMPILER_OPT_LEVEL", "NEURON_LAUNCH_BLOCKING",
                   "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS", "TORCH_NEURONX_MLIR_ATEN_OPS",
                   "TORCH_NEURONX_RETAIN_DEVICE_MODE", "TORCH_NEURONX_ENABLE_ASYNC_NRT"}


def test_the_compiler_environment_records_the_four_part_versions_under_its_old_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The full versions went into the key with the first Neuron warm-up (the installed distributions' own): no new
    entry, so no existing cache is split."""
    FakeNeuron().install(monkeypatch)
    settings = NeuronBackend().settings()
    assert set(settings) == NEURON_SETTINGS
    assert settings["torch-neuronx"] == "2.13.3.0" and settings["neuronx-cc"] == "2.28.7631.0"


def test_a_cache_warmed_under_another_build_is_named_by_verify_ls_and_import(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    from shapeplan.cache.archive import export_cache
    from shapeplan.cache.archive_import import import_cache
    from shapeplan.cache.listing import scan_cache_dir

    fake = FakeNeuron().install(monkeypatch)
    cache = tmp_path / "cache"
    backend = NeuronBackend()
    backend.prepare(cache)
    assert [r.status for r in warm(_plan(128), _warmer(fake.kernel), backend, cache).results] == ["compiled"]
    export_cache(cache, tmp_path / "a.tar.gz")
    assert scan_cache_dir(cache).plans[0].to_dict()["built_under"] == {"torch-neuronx": "2.13.3.0",
                                                                         "neuronx-cc": "2.28.7631.0"}
    assert scan_cache_dir(cache).plans[0].to_dict()["warning"] is None  # this machine's build

    monkeypatch.syspath_prepend(str(version_site(tmp_path / "site", "2.13.3.1")))  # Neuron 2.34's build
    with pytest.raises(CacheMismatchError) as refused:
        refuse_other_environment(cache, "neuron")  # what `verify` runs first
    said = str(refused.value)
    assert "torch-neuronx=2.13.3.0 (this machine: 2.13.3.1)" in said
    assert "two builds of torch-neuronx 2.13.3" in said and "cache reuse" in said
    with pytest.raises(CacheMismatchError, match=r"two builds of torch-neuronx 2\.13\.3"):
        import_cache(tmp_path / "a.tar.gz", tmp_path / "imported", device="neuron")
    assert not (tmp_path / "imported").exists()
    (plan,) = scan_cache_dir(cache).plans
    assert plan.warning is not None and "torch-neuronx 2.13.3.0" in plan.warning and "2.13.3.1" in plan.warning


def test_a_manifest_without_the_build_part_is_named_not_silently_split() -> None:
    """A manifest whose torch-neuronx version lacks its fourth part cannot tell which build warmed it."""
    here = {"versions": {}, "compiler": {"backend": "neuron", "torch-neuronx": "2.13.3.1"}}
    old = {"versions": {}, "compiler": {"backend": "neuron", "torch-neuronx": "2.13.3"}}
    found = mismatches(old, here)
    assert found[0] == "torch-neuronx=2.13.3 (this machine: 2.13.3.1)"
    assert any("without its fourth (build) part" in item for item in found)
    other_compiler = {"versions": {}, "compiler": {"backend": "neuron", "neuronx-cc": "2.28.7631.0"}}
    assert any("neuronx-cc 2.28.7631.0 and 2.29.100.0" in item for item in mismatches(
        other_compiler, {"versions": {}, "compiler": {"backend": "neuron", "neuronx-cc": "2.29.100.0"}}))


def test_warm_records_each_shape_s_keys_and_verify_checks_them(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    fake = FakeNeuron().install(monkeypatch)
    backend = NeuronBackend()
    backend.prepare(tmp_path)
    first = warm(_plan(128, 256), _warmer(fake.kernel), backend, tmp_path)
    assert [r.status for r in first.results] == ["compiled", "compiled"]
    shapes = _shapes(tmp_path)
    (key,) = shapes["train 2x128"]["keys"]
    # the C++ cache's key: the op's own key, then <target>_<lnc>_<opt>_<compiler args> (KernelExecution.cpp)
    assert key == "train 2x128_trn2_2_O1_--model-type_transformer_--auto-cast-none"
    assert shapes["train 2x128"]["keys"][key] >= 1  # its compile milliseconds
    assert neuron.key_parts(key) == {"op or graph": "train 2x128", "target": "trn2", "logical cores": "2",
                                     "opt level": "O1", "NEURON_CC_FLAGS": "<unset>"}

    fake.restart()  # verify: a fresh process on the warmed cache
    verified = warm(_plan(128, 256), _warmer(fake.kernel), backend, tmp_path, verify=True)
    assert [r.status for r in verified.results] == ["cached", "cached"]
    assert not verified.warnings  # every warmed key met, and loaded (0 ms)

    fake.restart()
    fake.module.neff_path("train 2x256").unlink()  # a NEFF lost from the cache dir
    ops = {"train 2x128": "train 2x128 other op"}  # and a shape whose step now runs another graph
    verified = warm(_plan(128, 256), _warmer(lambda key: fake.kernel(ops.get(key, key))), backend, tmp_path,
                    verify=True)
    assert [r.status for r in verified.results] == ["compiled", "compiled"]
    not_met, recompiled, lost = verified.warnings
    assert not_met.startswith("verify: train (2, 128): 1 of 1 key(s) the warm-up recorded were not met")
    assert "compiled key 'train 2x128 other op_trn2_2_O1_--model-type_transformer_--auto-cast-none'" in recompiled
    assert "no key the warm-up recorded has its op or graph" in recompiled
    assert lost.startswith("verify: train (2, 256) compiled again a key the warm-up compiled")
    assert "its NEFF is not in the cache dir" in lost


def test_key_parts_name_what_differs_from_the_warmed_key() -> None:
    warmed = {"aten::mm_t0_(2, 128)_torch.float32_trn2_2_O1_--model-type_transformer_--auto-cast-none": 900}
    new = "aten::mm_t0_(2, 128)_torch.float32_trn2_2_O1_--model-type_transformer_--auto-cast-none_--enable-x-1"
    assert neuron.key_differences(new, warmed) == "NEURON_CC_FLAGS <unset> -> '--enable-x-1'"
    assert neuron.key_parts("an 2.34 key of another layout") == {"key": "an 2.34 key of another layout"}


def test_without_the_bindings_the_counters_alone_decide(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeNeuron("no_cache_entries").install(monkeypatch)
    backend = NeuronBackend()
    backend.prepare(tmp_path)
    assert not hasattr(fake.module._C, "_get_compilation_cache_entries")
    assert not hasattr(fake.module._C, "_get_all_cache_keys")
    assert backend.compile_keys() is None
    assert [r.status for r in warm(_plan(128), _warmer(fake.kernel), backend, tmp_path).results] == ["compiled"]
    assert "keys" not in _shapes(tmp_path)["train 2x128"]
    fake.restart()
    verified = warm(_plan(128), _warmer(fake.kernel), backend, tmp_path, verify=True)
    assert [r.status for r in verified.results] == ["cached"] and not verified.warnings


def test_the_bindings_read_the_in_process_tier_as_upstream_fills_it(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """Entries appear once compiled (after the compile thread), a persistent hit is an entry of 0 ms, an in-process
    hit counts an access; metrics off do not hide them (they are no counters)."""
    fake = FakeNeuron("async").install(monkeypatch)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path))
    c = fake.module._C
    fake.kernel("mul 4x128")
    assert c._get_all_cache_keys() == set() and c._get_compilation_cache_entries() == []  # still compiling
    fake.module.synchronize()
    fake.kernel("mul 4x128")
    fake.module.synchronize()
    key = fake.module.cache_key("mul 4x128")
    (entry,) = c._get_compilation_cache_entries()
    assert entry["cache_key"] == key and entry["access_count"] == 1 and entry["compilation_time_ms"] >= 1
    assert entry["neff_size_bytes"] > 0 and c._get_all_cache_keys() == {key}
    fake.restart()
    fake.kernel("mul 4x128")
    fake.module.synchronize()
    assert c._get_compilation_cache_entries()[0]["compilation_time_ms"] == 0  # loaded from the cache dir
    graph = fake.module.cache_key("g", graph=True)
    assert graph.endswith("_trn2_2_O2_--model-type_transformer_--auto-cast-none")  # compiled graphs: -O2


@pytest.mark.parametrize(("mode", "code", "said"), [
    ("release_build", "-9", "neuronx-cc was killed (signal 9), most often by the out-of-memory killer"),
    ("release_build", "-6", "neuronx-cc aborted (signal 6)"),
    ("release_build", "-11", "neuronx-cc crashed (signal 11, a segmentation fault)"),
    ("", "-9", "neuronx-cc wrote no NEFF"),  # the C++ path reads a killed compiler as exit 0
    ("", "137", "neuronx-cc was killed (signal 9), most often by the out-of-memory killer"),
])
def test_a_compiler_killed_or_crashed_is_explained_in_the_failed_shape_s_line(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str, code: str, said: str) -> None:
    fake = FakeNeuron(*filter(None, [mode])).install(monkeypatch)
    backend = NeuronBackend()
    backend.prepare(tmp_path)
    monkeypatch.setenv("FAKE_NEURON_COMPILER_EXIT", code)
    (result,) = warm(_plan(128), _warmer(fake.kernel), backend, tmp_path).results
    assert result.status == "failed"
    assert result.error is not None and said in result.error


def test_an_unrelated_failure_is_left_as_it_was() -> None:
    backend = NeuronBackend.__new__(NeuronBackend)
    assert backend.explain_failure("ValueError: exit code 1 of something") == "ValueError: exit code 1 of something"


@pytest.mark.parametrize(("path", "rank"), [("/fsx/cache/rank_0/neff", "rank_0"), ("/fsx/neff/r3", "r3"),
                                            ("/fsx/neff_$LOCAL_RANK", "neff_$LOCAL_RANK"),
                                            ("/fsx/local_rank-1/n", "local_rank-1"), ("/fsx/r2d2/neff", None),
                                            ("/fsx/neff", None)])
def test_a_rank_in_a_cache_dir_path_is_found(path: str, rank: str | None) -> None:
    assert cachedir.rank_in_path(path) == rank


def test_warm_names_a_per_rank_cache_and_how_to_share_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeNeuron().install(monkeypatch)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", "/fsx/neff/r${LOCAL_RANK}")  # what the launcher script sets
    cache = tmp_path / "rank_0" / "neff"
    backend = NeuronBackend()
    backend.prepare(cache)
    warned = warm(_plan(128), _warmer(fake.kernel), backend, cache).warnings
    ours, theirs = [w for w in warned if "rank" in w]
    assert ours.startswith(f"cache dir {cache} holds a rank (rank_0): ")
    assert "ranks 1..N never read what rank 0 compiled" in ours and f"one dir for every rank (e.g. {tmp_path}/neff)" \
        in ours
    assert theirs.startswith("this environment's TORCH_NEURONX_NEFF_CACHE_DIR=/fsx/neff/r${LOCAL_RANK} holds a "
                             "rank (r${LOCAL_RANK})")


def test_a_cache_or_lock_dir_on_nfs_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/root / ext4 rw 0 0\nfs-1.efs:/ {tmp_path}/efs nfs4 rw,vers=4.1 0 0\n"
                      f"fs-2@tcp:/x {tmp_path}/fsx\\040space lustre rw 0 0\n")
    monkeypatch.setattr(cachedir, "MOUNTS", mounts)
    for point in ("efs", "fsx space"):
        (tmp_path / point).mkdir()
    assert cachedir.network_file_system(tmp_path / "efs" / "not" / "yet") == (f"{tmp_path}/efs", "nfs4")
    assert cachedir.network_file_system(tmp_path / "fsx space" / "c") == (f"{tmp_path}/fsx space", "lustre")
    assert cachedir.network_file_system(tmp_path / "local") is None
    FakeNeuron().install(monkeypatch)
    backend = NeuronBackend()
    monkeypatch.setenv("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", str(tmp_path / "efs" / "locks"))
    backend.prepare(tmp_path / "efs" / "cache")
    cache_note, lock_note = backend.warnings
    assert cache_note.startswith(f"cache dir {tmp_path}/efs/cache is on nfs4 (mounted at {tmp_path}/efs)")
    assert lock_note.startswith(f"TorchNeuron's lock dir {tmp_path}/efs/locks (TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR) "
                                "is on nfs4")
    assert "flock" in lock_note
    backend.prepare(tmp_path / "local", scratch=tmp_path / "scratch")  # verify's private lock dir
    assert backend.warnings == []


def _guarded(backend: NeuronBackend) -> Any:
    """A ShapeGuard counting on `backend`, started as at train begin (no trainer: its step boundaries are driven)."""
    from shapeplan import ShapeGuard

    backend.watch()
    guard = ShapeGuard(backend=backend)
    guard._start_counting()
    return guard


def test_the_guard_names_the_keys_a_step_compiled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Where the cache-entry bindings exist, a compile event names the keys first met in its step, with their parts
    and milliseconds (0: loaded from the cache dir), in the guard's line and in the run record."""
    from types import SimpleNamespace

    from shapeplan.guard.record import build_record

    fake = FakeNeuron().install(monkeypatch)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path))
    fake.kernel("aten::add 4x128")  # a warm-up compiled these into the cache dir
    fake.kernel("aten::mul 4x128")
    fake.restart()  # the training run: a fresh process on that cache
    guard = _guarded(NeuronBackend())
    fake.kernel("aten::add 4x128")
    guard._boundary(SimpleNamespace(global_step=1))  # loaded, nothing compiled
    assert guard.compiles == []
    fake.kernel("aten::add 4x128")  # an in-process hit: no key first met here
    fake.kernel("aten::mm 4x128")
    fake.kernel("aten::mul 4x128")  # loaded from the cache dir: 0 ms
    fake.kernel("aten::softmax 4x128")
    guard._boundary(SimpleNamespace(global_step=2))
    (event,) = guard.compiles
    mm, mul, softmax = (fake.module.cache_key(f"aten::{op} 4x128") for op in ("mm", "mul", "softmax"))
    assert [k["key"] for k in event.keys] == [mm, mul, softmax]
    assert [k["milliseconds"] >= 1 for k in event.keys] == [True, False, True] and event.keys[1]["milliseconds"] == 0
    assert event.keys[0]["parts"] == neuron.key_parts(mm) == {
        "op or graph": "aten::mm 4x128", "target": "trn2", "logical cores": "2", "opt level": "O1",
        "NEURON_CC_FLAGS": "<unset>"}
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "compiled" in line]
    assert line.startswith("shapeplan: step 2 compiled 2 key(s) (no new shape): 'aten::mm 4x128' (target trn2, "
                           "logical cores 2, opt level O1, NEURON_CC_FLAGS <unset>, ")
    assert "'aten::softmax 4x128'" in line and line.endswith("; 1 more loaded from the cache dir")
    record = build_record(SimpleNamespace(), _plan(128), (), guard.compiles, {}, steps=2)
    assert record["compiles"][0]["keys"] == [{"key": k, "milliseconds": e["milliseconds"], "parts": neuron.key_parts(k)}
                                             for k, e in zip((mm, mul, softmax), event.keys, strict=True)]
    json.dumps(record)  # the record stays JSON
    guard.no_compile = True  # the run after a bake: the error names the key too
    fake.kernel("aten::gelu 4x128")
    with pytest.raises(UnplannedShapeError, match=r"counters moved: .*; keys: 'aten::gelu 4x128' \(target trn2, "):
        guard._boundary(SimpleNamespace(global_step=3))


def test_without_the_bindings_the_guard_counts_as_before(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    fake = FakeNeuron("no_cache_entries").install(monkeypatch)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path))
    guard = _guarded(NeuronBackend())
    fake.kernel("aten::mm 4x128")
    guard._boundary(SimpleNamespace(global_step=1))
    (event,) = guard.compiles
    assert event.keys == () and event.delta["total_compilations"] == 1
    assert "keys" not in event.to_dict()
    assert "compiled" not in capsys.readouterr().err


def test_cache_ls_prints_the_other_build_warning_as_text(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from shapeplan.cli.cache import cache_group

    fake = FakeNeuron().install(monkeypatch)
    cache = tmp_path / "cache"
    backend = NeuronBackend()
    backend.prepare(cache)
    warm(_plan(128), _warmer(fake.kernel), backend, cache)
    listed = CliRunner().invoke(cache_group, ["ls", "--cache-dir", str(cache)])
    assert listed.exit_code == 0 and "warning" not in listed.output  # this machine's build
    monkeypatch.syspath_prepend(str(version_site(tmp_path / "site", "2.13.3.1")))
    listed = CliRunner().invoke(cache_group, ["ls", "--cache-dir", str(cache)])
    assert listed.exit_code == 0, listed.output
    (plan,) = scan_plans(cache)
    (line,) = [line for line in listed.output.splitlines() if "warning" in line]
    assert line == f"  warning: plan {plan.plan or '-'} ({plan.model}, {plan.method}): {plan.warning}"
    assert "torch-neuronx 2.13.3.0 and 2.13.3.1 are two builds" in line


def scan_plans(cache: Path) -> Any:
    from shapeplan.cache.listing import scan_cache_dir

    return scan_cache_dir(cache).plans
