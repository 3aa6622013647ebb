"""The Neuron backend against FakeNeuron: lazy import after the environment is set, counters, manifest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shapeplan.cli import main
from shapeplan.errors import CacheError, UsageError
from shapeplan.plan.model import Plan, PlanStats, Shape
from shapeplan.testing import FakeNeuron, FakeWarmer, fake_env, xla_site
from shapeplan.warm.backends import default_device, make_backend
from shapeplan.warm.backends.base import counter_delta
from shapeplan.warm.backends.neuron import NeuronBackend
from shapeplan.warm.manifest import MANIFEST, environment_key
from shapeplan.warm.runner import warm


def test_missing_torch_neuronx_names_the_fix(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "torch_neuronx" else object())
    with pytest.raises(UsageError):
        make_backend("neuron")
    assert main(["warm", "--plan", str(tmp_path / "p.json"), "--device", "neuron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["Error: --device neuron needs torch-neuronx, which is not installed; run `pip install "
                   "shapeplan[neuron]` on a Trainium (Trn2/Trn3) host with the Neuron SDK, or pass --device cpu"]


def test_neuron_is_the_default_device_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNeuron().install(monkeypatch)
    assert default_device() == "neuron"
    assert "torch_neuronx" not in sys.modules  # found, not imported


def test_environment_is_set_before_import_and_counters_are_read(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    fake = FakeNeuron().install(monkeypatch)
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type=transformer")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    backend = make_backend("neuron")
    backend.prepare(tmp_path)
    before = backend.counters()
    assert {"TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path),
                                         "TORCH_NEURONX_METRICS_ENABLED": "1"} == fake.module.ENV_AT_IMPORT
    fake.kernel("matmul 2x128")
    fake.kernel("add 2x128")
    fake.kernel("matmul 2x128")  # the in-process tier
    delta = counter_delta(before, backend.counters())
    assert delta == {"in_memory_hits": 1, "in_memory_misses": 2, "persistent_misses": 2, "total_compilations": 2,
                     "CompilationCache.PersistentMisses": 2, "CompilationCache.TotalCompilations": 2,
                     "neff_files": 2}
    assert backend.compiled(delta) and not backend.hit(delta)
    assert len(list(tmp_path.glob("*/*/*.neff"))) == 2  # sharded ab/cd/<key>.neff

    fake.restart()  # a fresh process on the same cache: persistent hits, nothing compiled
    before = backend.counters()
    fake.kernel("matmul 2x128")
    delta = counter_delta(before, backend.counters())
    assert delta == {"in_memory_misses": 1, "persistent_hits": 1, "CompilationCache.PersistentHits": 1}
    assert backend.hit(delta) and not backend.compiled(delta)
    assert backend.script_lines(tmp_path, torch_compile=False, graphs=3) == (
        f"export TORCH_NEURONX_NEFF_CACHE_DIR={tmp_path}", "export NEURON_CC_FLAGS=--model-type=transformer",
        "export NEURON_LOGICAL_NC_CONFIG=2")


def test_counters_are_read_after_the_compile_thread_finishes(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    fake = FakeNeuron("async").install(monkeypatch)
    backend = make_backend("neuron")
    backend.prepare(tmp_path)
    before = backend.counters()
    fake.kernel("matmul 2x256")
    unsynchronized = fake.module._C._get_compilation_cache_stats()
    assert unsynchronized["total_compilations"] == 0 and not list(tmp_path.rglob("*.neff"))  # still compiling
    delta = counter_delta(before, backend.counters())
    assert delta["total_compilations"] == 1 and delta["neff_files"] == 1 and backend.compiled(delta)


def test_a_persistent_cache_that_failed_to_start_still_shows_the_compile(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    fake = FakeNeuron("cache_failed").install(monkeypatch)
    backend = make_backend("neuron")
    backend.prepare(tmp_path)
    before = backend.counters()
    fake.kernel("matmul 2x384")
    delta = counter_delta(before, backend.counters())
    # no persistent miss is counted and no file written: only the compile counter tells
    assert delta == {"in_memory_misses": 1, "total_compilations": 1, "CompilationCache.TotalCompilations": 1}
    assert backend.compiled(delta)


@pytest.mark.parametrize(("mode", "present"), [("no_metrics", "total_compilations"),
                                               ("no_stats", "CompilationCache.TotalCompilations")])
def test_either_counter_source_is_enough(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str,
                                         present: str) -> None:
    fake = FakeNeuron(mode).install(monkeypatch)
    backend = make_backend("neuron")
    backend.prepare(tmp_path)
    assert list(backend.sources().values()).count(True) == 1
    before = backend.counters()
    fake.kernel("mul 4x128")
    delta = counter_delta(before, backend.counters())
    assert delta[present] == 1 and backend.compiled(delta)


def test_new_neff_files_alone_mean_compiled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Metrics that never got enabled and no stats call: the counters stay still, the cache dir does not."""
    fake = FakeNeuron("no_stats").install(monkeypatch)
    backend = make_backend("neuron")
    backend.prepare(tmp_path)
    monkeypatch.delenv("TORCH_NEURONX_METRICS_ENABLED")  # e.g. a release that reads another name
    before = backend.counters()
    fake.kernel("mul 4x256")
    assert counter_delta(before, backend.counters()) == {"neff_files": 1}
    assert backend.compiled({"neff_files": 1})


def test_no_counter_source_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    FakeNeuron("no_stats", "no_metrics").install(monkeypatch)
    backend = make_backend("neuron")
    backend.prepare(tmp_path)
    with pytest.raises(CacheError, match=r"neither _C\._get_compilation_cache_stats nor torch_neuronx\.metrics"):
        backend.counters()


def test_an_xla_era_package_or_a_trn1_host_is_refused_before_loading(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    with monkeypatch.context() as patched:
        FakeNeuron().install(patched)
        patched.syspath_prepend(str(xla_site(tmp_path / "site")))
        with pytest.raises(UsageError, match=r"^torch-neuronx 2\.9\.0 is the PyTorch/XLA stack"):
            make_backend("neuron")
        assert "torch_neuronx" not in sys.modules
    with monkeypatch.context() as patched:
        FakeNeuron().install(patched)
        patched.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
        with pytest.raises(UsageError, match=r"^this is a Trn1/Inf2 host"):
            make_backend("neuron")
    FakeNeuron("xla").install(monkeypatch)  # metadata that does not tell: the missing torch.neuron does
    backend = make_backend("neuron")
    backend.prepare(tmp_path)
    with pytest.raises(UsageError, match=r"has no torch\.neuron device"):
        backend.counters()


def test_xla_era_refusal_through_the_console_script(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    env = fake_env(site=xla_site(tmp_path / "site"))
    done = subprocess.run([str(Path(sys.executable).parent / "shapeplan"), "warm", "--plan", str(plan), "--device",
                           "neuron", "--cache-dir", str(tmp_path / "c")], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        ("Error: torch-neuronx 2.9.0 is the PyTorch/XLA stack, which shapeplan does not warm; use TorchNeuron: "
         "torch-neuronx >= 2.13 on a Trn2/Trn3 host, Python >= 3.12, installed from the Neuron pip index; or pass "
         "--device cpu")]


def test_settings_hold_the_target_and_code_changing_settings_normalized(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNeuron().install(monkeypatch)
    for name in ("NEURON_LOGICAL_NC_CONFIG", "NEURON_COMPILER_OPT_LEVEL", "NEURON_CC_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    backend = make_backend("neuron")
    unset = backend.settings()
    assert unset["target"] == "trn2" and unset["torch-neuronx"] == FakeNeuron.version
    assert unset["NEURON_LOGICAL_NC_CONFIG"] == "2" and unset["NEURON_COMPILER_OPT_LEVEL"] == "default"
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")  # the platform default, spelled out: the same key
    monkeypatch.setenv("TORCH_NEURONX_LOG_LEVEL", "3")  # changes no code
    assert backend.settings() == unset
    monkeypatch.setenv("TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS", "1")
    monkeypatch.setenv("TORCH_NEURONX_ENABLE_STABLEHLO", "0")
    assert backend.settings() == {**unset, "TORCH_NEURONX_ENABLE_STABLEHLO": "0",
                                  "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS": "1"}
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    assert backend.settings()["target"] == "trn3"


def _plan(*seqs: int) -> Plan:
    shapes = tuple(Shape(phase="train", batch=2, seq=s, count=1, first_step=1) for s in seqs)
    return Plan(method="sft", exact=True, pad_to_multiple_of=128, shapes=shapes,
                stats=PlanStats(rows=4, dropped_rows=0, micro_batches=len(seqs), optimizer_steps=len(seqs),
                                tokens=1, padded_tokens=1))


def test_warm_records_the_manifest_and_skips_what_it_holds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeNeuron().install(monkeypatch)
    backend = NeuronBackend()
    backend.prepare(tmp_path)
    first = warm(_plan(128, 256, -1), FakeWarmer(fake.kernel, fail={"train 2x-1"}), backend, tmp_path)
    assert [(r.task.seq, r.status) for r in first.results] == [(128, "compiled"), (256, "compiled"), (-1, "failed")]
    assert first.results[0].counters["persistent_misses"] == 1

    manifest = json.loads((tmp_path / MANIFEST).read_text())
    (env_key, section), = manifest["environments"].items()
    assert env_key == environment_key(first.environment)
    assert section["environment"]["compiler"]["backend"] == "neuron"
    assert {k: v["status"] for k, v in section["shapes"].items()} == {
        "train 2x128": "compiled", "train 2x256": "compiled", "train 2x-1": "failed"}

    second = warm(_plan(128, 256, 384), FakeWarmer(fake.kernel), backend, tmp_path)
    assert [(r.task.seq, r.status) for r in second.results] == [(128, "skipped"), (256, "skipped"),
                                                                (384, "compiled")]
    fake.restart()  # verify runs in a fresh process
    verified = warm(_plan(128, 256, 384), FakeWarmer(fake.kernel), backend, tmp_path, verify=True)
    assert [r.status for r in verified.results] == ["cached", "cached", "cached"]
