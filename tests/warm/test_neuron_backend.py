"""The Neuron backend against FakeNeuron: lazy import after the environment is set, counters, manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shapeplan.cache.contents import cache_files
from shapeplan.cli import main
from shapeplan.errors import CacheError, UsageError
from shapeplan.plan.model import Plan, PlanStats, Shape
from shapeplan.testing import FakeNeuron, FakeWarmer, fake_env, xla_site
from shapeplan.warm.backends import default_device, make_backend, neuron
from shapeplan.warm.backends.base import counter_delta
from shapeplan.warm.backends.neuron import SYNC_COMPILER, NeuronBackend
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
                   "shapeplan[neuron] --extra-index-url https://pip.repos.neuron.amazonaws.com` on a Trainium "
                   "(Trn2/Trn3) host with the Neuron SDK, or pass --device cpu"]


def test_neuron_is_the_default_device_where_it_has_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """As transformers and accelerate decide: `torch.neuron.is_available()`, asked without loading it here."""
    FakeNeuron().install(monkeypatch)
    assert default_device() == "neuron"
    assert "torch_neuronx" not in sys.modules  # asked in a child process, not imported here
    monkeypatch.setenv("FAKE_NEURON", "no_device")  # installed, but the runtime sees no NeuronCore
    assert default_device() == "cpu"


def test_counters_need_metrics_and_a_miss_is_not_a_compile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeNeuron().install(monkeypatch)
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type=transformer")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    backend = make_backend("neuron")
    backend.prepare(tmp_path)
    before = backend.counters()
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
    # what another process wrote while this one waited for the lock: a miss, then a hit, and no compile
    raced = {"in_memory_misses": 1, "persistent_misses": 1, "persistent_hits": 1,
             "CompilationCache.PersistentMisses": 1, "CompilationCache.PersistentHits": 1}
    assert backend.hit(raced) and not backend.compiled(raced)
    assert backend.script_lines(tmp_path, torch_compile=False, graphs=3)[:4] == (
        f"export TORCH_NEURONX_NEFF_CACHE_DIR={tmp_path}", "export NEURON_LAUNCH_BLOCKING=0",
        "export NEURON_CC_FLAGS=--model-type=transformer", "export NEURON_LOGICAL_NC_CONFIG=2")
    # a torch_compile run also needs dynamo's static shapes, which `trl sft` users can only set in the environment
    from shapeplan.warm.backends import inductor

    monkeypatch.setattr(inductor, "dynamo_settings",  # as torch's (importing dynamo takes seconds)
                        lambda graphs: {"automatic_dynamic_shapes": False, "recompile_limit": max(graphs, 8)})
    compiled = backend.script_lines(tmp_path, torch_compile=True, graphs=3)
    assert "export TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0" in compiled
    assert not any("recompile_limit" in line for line in compiled)  # 3 graphs: torch's default limit holds them
    assert "torch._dynamo.config.recompile_limit = 12" in backend.script_lines(tmp_path, torch_compile=True,
                                                                                graphs=12)
    assert "export TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0" not in backend.script_lines(tmp_path, torch_compile=False,
                                                                                         graphs=3)


RACE = """
import sys, torch, torch_neuronx
torch_neuronx.kernel("matmul 8x1024")
stats = torch_neuronx._C._get_compilation_cache_stats()
print(stats["persistent_misses"], stats["persistent_hits"], stats["total_compilations"])
"""


def _wait(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 240
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_miss_that_waited_for_another_process_compile_is_a_hit(tmp_path: Path) -> None:
    """Two processes meet one new kernel: the second misses, waits on the first's lock, then finds its NEFF."""
    release = tmp_path / "release"
    env = fake_env(TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "cache"), TORCH_NEURONX_METRICS_ENABLED="1",
                   FAKE_NEURON_TMP=str(tmp_path), FAKE_NEURON_COMPILE_UNTIL=str(release))
    first = subprocess.Popen([sys.executable, "-c", RACE], env=env, stdout=subprocess.PIPE, text=True)
    locks = tmp_path / "local_cache" / "locks"
    _wait(lambda: bool(list(locks.glob("*.lock"))) or first.poll() is not None)  # it compiles, holding the lock
    (lock,) = locks.glob("*.lock")
    second = subprocess.Popen([sys.executable, "-c", RACE], env=env, stdout=subprocess.PIPE, text=True)
    inode = f":{lock.stat().st_ino} "
    # the second one missed and waits for the lock (a blocked flock shows as "->" in /proc/locks)
    _wait(lambda: any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())
          or second.poll() is not None)
    release.touch()
    second_out = second.communicate(timeout=300)[0]
    assert first.communicate(timeout=300)[0].split() == ["1", "0", "1"]
    assert second_out.split() == ["1", "1", "0"]  # a miss, then a hit: nothing compiled
    # the first process's NEFF landed in the shared dir during the second one's interval: still not its compile
    delta = {"persistent_misses": 1, "persistent_hits": 1, "neff_files": 1}
    assert not NeuronBackend.compiled(NeuronBackend.__new__(NeuronBackend), delta)


def test_a_neff_another_process_wrote_is_not_this_process_compile(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """A shared cache dir (warm workers, fleet shards, data-parallel ranks): a NEFF another process wrote during the
    interval is its compile; and a NEFF of size 0 is a miss (PersistentCacheBackend::Get), not a warmed shape."""
    fake = FakeNeuron().install(monkeypatch)
    backend = make_backend("neuron")
    backend.prepare(tmp_path)
    fake.kernel("matmul 2x1152")
    fake.restart()
    before = backend.counters()
    other = fake.module.neff_path("add 2x1152")  # another worker's compile lands meanwhile
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_bytes(b"neff")
    fake.kernel("matmul 2x1152")  # this process: a persistent hit
    delta = counter_delta(before, backend.counters())
    assert delta["neff_files"] == 1 and delta["persistent_hits"] == 1
    assert backend.hit(delta) and not backend.compiled(delta)
    guard = make_backend("neuron")
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path))
    guard.watch()  # async mode: the guard counts no files, so no step boundary walks the cache
    assert "neff_files" not in guard.counters()

    empty = fake.module.neff_path("mul 2x1152")
    empty.parent.mkdir(parents=True, exist_ok=True)
    empty.touch()  # a truncated copy
    assert neuron.count_neffs(tmp_path) == 2
    assert empty not in set(cache_files(tmp_path))  # not exported or pushed
    before = backend.counters()
    fake.kernel("mul 2x1152")
    delta = counter_delta(before, backend.counters())
    assert delta["persistent_misses"] == 1 and delta["total_compilations"] == 1 and backend.compiled(delta)
    assert not list(tmp_path.rglob(".tmp.*"))  # upstream's temporaries are renamed into place


@pytest.mark.parametrize("setting", [("TORCH_NEURONX_NEFF_DISABLE_CACHE", "1"),
                                     ("TORCH_NEURONX_DISABLE_NEFF_CACHE", "true")])
def test_a_warm_up_into_a_disabled_cache_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    setting: tuple[str, str]) -> None:
    fake = FakeNeuron("release_build").install(monkeypatch)  # sync mode: both variables are read there
    monkeypatch.setenv(*setting)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "cache"))
    fake.kernel("matmul 2x1280")
    # the persistent tier off: nothing kept; the in-process one off: every call compiles again
    assert len(list((tmp_path / "cache").rglob("*.neff"))) == (setting[0] != "TORCH_NEURONX_NEFF_DISABLE_CACHE")
    with pytest.raises(UsageError, match=rf"^{setting[0]}={setting[1]} turns TorchNeuron's NEFF cache off"):
        make_backend("neuron").prepare(tmp_path)


def test_metrics_off_count_nothing_in_either_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Upstream, the stats call and torch_neuronx.metrics read one arena, gated by the metrics switch."""
    fake = FakeNeuron().install(monkeypatch)
    backend = make_backend("neuron")
    backend.cache_dir = tmp_path  # not prepared: the metrics variable is never set
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path))
    before = backend.counters()
    fake.kernel("mul 4x256")
    delta = counter_delta(before, backend.counters())
    assert delta == {"neff_files": 1} and backend.compiled(delta)  # only the file tells, where nothing counts
    assert fake.module._C._get_compilation_cache_stats()["total_compilations"] == 0


def test_the_guard_switches_metrics_on_in_a_process_that_read_them_off(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    fake = FakeNeuron().install(monkeypatch)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path))
    fake.kernel("mul 4x384")  # a device op before the guard: metrics are now read, and off
    assert not fake.module.metrics_enabled()
    backend = make_backend("neuron")
    assert backend.watch() is None
    assert backend.cache_dir is None  # async mode: the counters alone, no walk of the cache at each boundary
    before = backend.counters()
    fake.kernel("mul 4x512")
    assert counter_delta(before, backend.counters())["total_compilations"] == 1


def test_the_guard_says_when_it_cannot_count(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNeuron("metrics_off").install(monkeypatch)
    fake.kernel("mul 4x640")
    reason = make_backend("neuron").watch()
    assert reason is not None and "TORCH_NEURONX_METRICS_ENABLED=1" in reason


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


def test_sync_mode_compiles_show_only_as_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """NEURON_LAUNCH_BLOCKING=1: eager ops take the Python compile path, <sha>/<sha>.neff and no counter."""
    fake = FakeNeuron("release_build").install(monkeypatch)
    backend = make_backend("neuron")
    backend.prepare(tmp_path)
    before = backend.counters()
    assert backend.settings()["NEURON_LAUNCH_BLOCKING"] == "1 (sync)"  # the release build's import default
    fake.kernel("matmul 2x768")
    delta = counter_delta(before, backend.counters())
    assert delta == {"neff_files": 1} and backend.compiled(delta)
    (neff,) = tmp_path.rglob("*.neff")
    assert neff.parent.name == neff.stem and len(neff.stem) == 64
    fake.restart()
    before = backend.counters()
    eager = backend.settings()
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type=transformer")
    monkeypatch.setenv("NEURON_COMPILER_OPT_LEVEL", "3")
    fake.kernel("matmul 2x768")
    # loaded, flags or not: this path compiles at a fixed -O1 and keys neither; nothing tells a hit in this mode
    assert counter_delta(before, backend.counters()) == {} and len(list(tmp_path.rglob("*.neff"))) == 1
    assert backend.settings() == eager  # so recorded: the eager cache serves a host that differs only there
    assert eager["NEURON_CC_FLAGS"] == "none (sync mode's fixed flags)"
    backend.torch_compile = True  # compiled graphs take the C++ path, which passes and keys both
    graphs = backend.settings()
    assert graphs["NEURON_CC_FLAGS"] == "--model-type=transformer" and graphs["NEURON_COMPILER_OPT_LEVEL"] == "3"


def test_the_compiler_flags_key_async_modes_compiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeNeuron().install(monkeypatch)
    backend = make_backend("neuron")
    backend.prepare(tmp_path)
    fake.kernel("matmul 2x768")
    fake.restart()
    monkeypatch.setenv("NEURON_CC_FLAGS", "")  # set, if empty: passed on and keyed
    before = backend.counters()
    fake.kernel("matmul 2x768")
    assert backend.compiled(counter_delta(before, backend.counters()))
    assert len(list(tmp_path.rglob("*.neff"))) == 2
    assert backend.settings()["NEURON_CC_FLAGS"] == ""


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
        instance = tmp_path / "product_name"
        instance.write_text("trn1.32xlarge\n")
        patched.setattr(neuron, "INSTANCE_TYPE_FILE", instance)
        with pytest.raises(UsageError, match=r"^this is a Trn1/Inf2 host"):
            make_backend("neuron")
        assert "torch_neuronx" not in sys.modules
    with monkeypatch.context() as patched:  # the runtime's own target, once loaded
        FakeNeuron().install(patched)
        patched.setenv("FAKE_NEURON_TARGET", "trn1")
        backend = make_backend("neuron")
        with pytest.raises(UsageError, match=r"^this is a Trn1/Inf2 host"):
            backend.settings()
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
         "torch-neuronx >= 2.13 on a Trn2/Trn3 host, installed from the Neuron pip index; or pass --device cpu")]


def test_settings_are_read_after_the_import_defaults_and_normalized(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNeuron().install(monkeypatch)
    for name in ("NEURON_LOGICAL_NC_CONFIG", "NEURON_COMPILER_OPT_LEVEL", "NEURON_CC_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    backend = make_backend("neuron")
    assert "TORCH_NEURONX_MLIR_ATEN_OPS" not in os.environ  # not loaded yet
    unset = backend.settings()  # loads it: its import defaults are part of what it compiles with
    assert unset["TORCH_NEURONX_MLIR_ATEN_OPS"] == "1" and unset["TORCH_NEURONX_ENABLE_ASYNC_NRT"] == "1"
    assert "TORCH_NEURONX_ENABLE_STACK_TRACE" not in unset  # set at import too, but changes no code
    assert unset["target"] == "trn2" and unset["torch-neuronx"] == FakeNeuron.version
    assert unset["NEURON_LOGICAL_NC_CONFIG"] == "2" and unset["NEURON_COMPILER_OPT_LEVEL"] == "default"
    assert unset["NEURON_LAUNCH_BLOCKING"] == "async" and unset["NEURON_CC_FLAGS"] == "<unset>"
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")  # the platform default, spelled out: the same key
    for name in ("TORCH_NEURONX_LOG_LEVEL", "TORCH_NEURONX_METRICS_DIR", "TORCH_NEURONX_ENABLED_METRIC_TABLES"):
        monkeypatch.setenv(name, "3")  # change no code
    assert backend.settings() == unset
    monkeypatch.setenv("NEURON_CC_FLAGS", "")  # set, if empty: upstream appends " " to the key
    assert backend.settings()["NEURON_CC_FLAGS"] == ""
    monkeypatch.delenv("NEURON_CC_FLAGS")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "")  # read whenever set
    assert backend.settings()["NEURON_LOGICAL_NC_CONFIG"] == ""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    monkeypatch.setenv("NEURON_LAUNCH_BLOCKING", "1")
    assert backend.settings() == {**unset, "NEURON_LAUNCH_BLOCKING": "1 (sync)", **SYNC_COMPILER}
    monkeypatch.setenv("NEURON_LAUNCH_BLOCKING", "0")
    monkeypatch.setenv("TORCH_NEURONX_ENABLE_STABLEHLO", "0")
    assert backend.settings() == {**unset, "TORCH_NEURONX_ENABLE_STABLEHLO": "0"}
    monkeypatch.setenv("FAKE_NEURON_TARGET", "trn3")
    assert backend.settings()["target"] == "trn3"
    assert fake.module.__name__ == "torch_neuronx"


def test_visible_cores_follow_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "3")
    assert neuron.visible_cores() == [0, 1, 2]
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-5")  # wins over NUM_CORES
    assert neuron.visible_cores() == [4, 5]
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    monkeypatch.delenv("NEURON_RT_NUM_CORES")
    FakeNeuron().install(monkeypatch)
    monkeypatch.setenv("FAKE_NEURON_CORES", "6")
    make_backend("neuron").settings()  # loaded: the runtime's own count
    assert neuron.visible_cores() == list(range(6))
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "0")  # the runtime's documented default: all cores
    assert neuron.visible_cores() == list(range(6)) and neuron.requested_cores() is None
    from shapeplan.services.doctor import cores

    assert cores("neuron") == {"visible": list(range(6)), "count": 6, "from": "torch.neuron.device_count()"}
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "x")
    with pytest.raises(UsageError, match="NEURON_RT_NUM_CORES='x' is not a number of cores"):
        neuron.visible_cores()


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
    assert first.results[0].counters["total_compilations"] == 1

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


def test_a_guarded_run_counts_compiles_on_neuron_and_none_on_a_warmed_cache(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """ShapeGuard's step boundaries against the strict fake: the run's device op came first (metrics read off),
    the guard is built before the Trainer and watches the run's own cache dir."""
    from types import SimpleNamespace

    from shapeplan.guard.callback import ShapeGuard

    fake = FakeNeuron().install(monkeypatch)
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path))
    fake.kernel("embedding 4x128")  # warmed: this process compiles it now, and writes its NEFF
    guard = ShapeGuard()
    guard.backend = make_backend("neuron")
    assert guard.backend.watch() is None
    fake.restart()  # training: a fresh process on the warmed cache
    guard._counters = guard._read_counters()
    fake.kernel("embedding 4x128")
    guard._boundary(SimpleNamespace(global_step=1))
    assert guard.compiles == []  # loaded from the cache
    fake.kernel("embedding 4x256")  # not warmed
    guard._boundary(SimpleNamespace(global_step=2))
    (event,) = guard.compiles
    assert event.step == 2 and event.delta["total_compilations"] == 1
    other = fake.module.neff_path("embedding 8x128")  # another rank compiles into the shared dir meanwhile
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_bytes(b"neff")
    fake.kernel("embedding 4x256")
    guard._boundary(SimpleNamespace(global_step=3))
    assert guard.compiles == [event]  # that rank's compile, not this one's


def test_compiled_graph_caches_record_the_source_paths_their_keys_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph's key hashes MLIR bytecode with source locations: another venv path misses every graph (eager keys
    print no locations, so eager caches do not record them)."""
    from shapeplan.warm.manifest import machine_environment, mismatches

    FakeNeuron().install(monkeypatch)
    backend = make_backend("neuron")
    eager = {"versions": {}, "compiler": backend.settings()}
    assert not set(neuron.SOURCE_PATHS) & set(eager["compiler"])
    monkeypatch.setattr("shapeplan.warm.backends.inductor.apply_dynamo_settings", lambda graphs: None)  # dynamo's
    backend.configure(torch_compile=True, graphs=1)
    compiled = {"versions": {}, "compiler": backend.settings()}
    assert compiled["compiler"]["python prefix"] == sys.prefix
    here = {"versions": {}, "compiler": machine_environment("neuron")["compiler"]}
    assert mismatches(eager, here) == [] and mismatches(compiled, here) == []
    moved = {"versions": {}, "compiler": {**compiled["compiler"], "site-packages": "/opt/other/site-packages"}}
    found = mismatches(moved, here)
    assert found[0].startswith("site-packages=/opt/other/site-packages (this machine: ") and "docs/bake.md" in found[1]
