"""TorchNeuron as its source behaves, through the console script against the strict fake
(shapeplan/testing/fake_site): in every child process `import torch` autoloads it and applies its defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shapeplan.testing import fake_env
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL

SHAPEPLAN = str(Path(sys.executable).parent / "shapeplan")
# A warm-up on this "host" in a process of its own: the fake's kernels as the warmer, the real runner and manifest.
WARM = """
import sys
from pathlib import Path
from shapeplan.plan.model import Plan, PlanStats, Shape
from shapeplan.testing import FakeWarmer
from shapeplan.warm.backends.neuron import NeuronBackend
from shapeplan.warm.manifest import MACHINE_PACKAGES
from shapeplan.warm.runner import warm
from shapeplan.adapters.host import installed_versions

cache = Path(sys.argv[1])
backend = NeuronBackend()
backend.prepare(cache)  # before torch loads, as `shapeplan warm` does: sync mode's dirs are fixed at import
import torch_neuronx
plan = Plan(method="sft", exact=True, pad_to_multiple_of=128,
            shapes=(Shape(phase="train", batch=2, seq=128, count=1, first_step=1),),
            stats=PlanStats(rows=2, dropped_rows=0, micro_batches=1, optimizer_steps=1, tokens=1, padded_tokens=1))
versions = installed_versions(MACHINE_PACKAGES)  # what a real warmer's environment records
warmer = FakeWarmer(torch_neuronx.kernel, environment={"method": "sft", "versions": versions})
print(" ".join(r.status for r in warm(plan, warmer, backend, cache).results))
"""


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)


def _warm(cache: Path, env: dict[str, str]) -> str:
    done = _run([sys.executable, "-c", WARM, str(cache)], env, cache.parent)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_cache_imports_on_the_host_that_warmed_it_and_not_in_the_other_mode(tmp_path: Path) -> None:
    env = fake_env()
    assert _warm(tmp_path / "cache", env) == "compiled"
    assert _run([SHAPEPLAN, "cache", "export", "--cache-dir", "cache", "-o", "a.tar.gz"], env, tmp_path).returncode == 0
    # the same host: torch-neuronx's import-time defaults are part of both descriptions
    done = _run([SHAPEPLAN, "cache", "import", "a.tar.gz", "--cache-dir", "same"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    # a build host without Neuron devices (an AMI built on a CPU instance): torch-neuronx does not import there
    done = _run([SHAPEPLAN, "cache", "import", "a.tar.gz", "--cache-dir", "cpu-host"],
                fake_env("no_instance", FAKE_NEURON_TMP=str(tmp_path)), tmp_path)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 3 and "this machine cannot use a neuron cache: torch-neuronx cannot import" in line
    assert "`cache import`, `cache pull`, `warm`, `verify` and `doctor --device neuron` need a Trn2/Trn3" in line
    assert not (tmp_path / "cpu-host").exists()
    sync = {**env, "NEURON_LAUNCH_BLOCKING": "1"}  # eager ops take another compile path with other keys
    done = _run([SHAPEPLAN, "cache", "import", "a.tar.gz", "--cache-dir", "sync"], sync, tmp_path)
    assert done.returncode == 3, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "NEURON_LAUNCH_BLOCKING=async (this machine: 1 (sync))" in line
    done = _run([SHAPEPLAN, "verify", "--plan", "plan.json", "--device", "neuron", "--cache-dir", "cache"], sync,
                tmp_path)
    assert done.returncode == 3, done.stderr
    assert "was warmed in another environment: " in done.stderr  # the mode, and the compiler settings it fixes
    assert "NEURON_LAUNCH_BLOCKING=async (this machine: 1 (sync))" in done.stderr
    # and a warm-up in the other mode does not take the first one's shapes as its own
    assert _warm(tmp_path / "cache", sync) == "compiled"
    assert _warm(tmp_path / "cache", env) == "skipped"
    # sync mode's eager compiles read no flags: its shapes serve a host whose flags differ
    assert _warm(tmp_path / "flags", {**sync, "NEURON_CC_FLAGS": "--model-type=transformer"}) == "compiled"
    exported = _run([SHAPEPLAN, "cache", "export", "--cache-dir", "flags", "-o", "s.tar.gz"], sync, tmp_path)
    assert exported.returncode == 0, exported.stderr
    done = _run([SHAPEPLAN, "cache", "import", "s.tar.gz", "--cache-dir", "sync"], sync, tmp_path)
    assert done.returncode == 0 and "imported 1 warmed shape(s)" in done.stderr + done.stdout, done.stderr


def test_the_guard_turns_the_counters_on_before_the_command_runs(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch, torch_neuronx\ntorch_neuronx.kernel('matmul 2x128')\n"
                      "print(torch_neuronx.metrics_enabled(), "
                      "torch_neuronx._C._get_compilation_cache_stats()['total_compilations'])\n")
    env = fake_env(TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "cache"), FAKE_NEURON_TMP=str(tmp_path))
    done = _run([SHAPEPLAN, "guard", "--", "python", str(script)], env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True 1"


def test_the_guarded_command_runs_as_it_would_unguarded(tmp_path: Path) -> None:
    """Its first lines run before torch loads, so what it sets there reaches TorchNeuron's import (sync mode's
    cache dir is fixed then): its NEFFs land where they land unguarded."""
    script = tmp_path / "train.py"
    script.write_text("import os, sys\nprint('torch' in sys.modules)\nos.environ['TORCH_NEURONX_NEFF_CACHE_DIR'] = "
                      "sys.argv[1]\nos.environ['NEURON_LAUNCH_BLOCKING'] = '1'\nimport torch, torch_neuronx\n"
                      "torch_neuronx.kernel('matmul 2x1408')\n")
    env = fake_env(FAKE_NEURON_TMP=str(tmp_path))
    for name, command in (("plain", [sys.executable]), ("guarded", [SHAPEPLAN, "guard", "--", "python"])):
        done = _run([*command, str(script), str(tmp_path / name)], env, tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[0] == "False", name
        assert len(list((tmp_path / name).rglob("*.neff"))) == 1, name


@pytest.mark.slow
def test_a_warm_up_through_the_real_trainer_leaves_the_guarded_real_run_nothing_to_compile(tmp_path: Path) -> None:
    """`warm --device neuron` runs the real SFT step on the device the Trainer picks; `trl sft` under the guard, on
    that cache, then compiles nothing, the guard's own reading of the batches included (a device op there would be
    a kernel the unguarded run never meets: it reads host copies)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(CAPYBARA.read_text(encoding="utf-8"), encoding="utf-8")
    run = ["--model_name_or_path", str(TINY_MODEL), "--per_device_train_batch_size", "4", "--max_length", "256",
           "--pad_to_multiple_of", "128", "--max_steps", "2"]
    env = fake_env("device", FAKE_NEURON_TMP=str(tmp_path), TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "cache"))
    done = _run([SHAPEPLAN, "analyze", str(data), *run, "-o", "plan.json"], env, tmp_path)
    assert done.returncode == 0, done.stderr
    done = _run([SHAPEPLAN, "warm", "--plan", "plan.json", "--device", "neuron", "--cache-dir", "cache"], env, tmp_path)
    assert done.returncode == 0 and "1 compiled" in done.stdout + done.stderr, done.stderr
    done = _run([SHAPEPLAN, "guard", "--plan", "plan.json", "--", "trl", "sft", "--dataset_name", str(data), *run,
                 "--output_dir", "out", "--report_to", "none", "--save_strategy", "no"],
                {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1/1 planned shapes met, 0 unplanned, 0 compiles" in done.stderr, done.stderr[-3000:]


def test_analyze_warns_about_shapes_the_nki_attention_kernel_recompiles(tmp_path: Path) -> None:
    args = [SHAPEPLAN, "analyze", str(CAPYBARA), "--model", str(TINY_MODEL), "--max_length", "512", "--packing",
            "true", "--packing_strategy", "wrapped", "--per_device_train_batch_size", "2", "--num_train_epochs", "1"]
    env = {**fake_env(), "PYTHONPATH": str(ROOT)}
    done = _run(args, env, tmp_path)
    assert done.returncode == 0, done.stderr
    (warning,) = [line for line in done.stderr.splitlines() if "NKI flash-attention" in line]
    assert "at seq 512 hold no padding" in warning and "--attn_implementation eager" in warning
    done = _run([*args, "--attn_implementation", "eager"], env, tmp_path)
    assert done.returncode == 0 and "NKI" not in done.stderr


def test_the_device_report_answers_what_neuron_2_34_changed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The probes of issue #56, in fresh processes against the fake (which answers as the 2.34 docs and the April
    bindings say, and says so): the HLO cache and debug dirs after one eager and one compiled step, the eager keys
    from another install path, the four-part versions and the cache-entry bindings."""
    from shapeplan.testing import FakeNeuron
    from shapeplan.warm.backends import neuron_probe

    FakeNeuron("device").install(monkeypatch)  # the children import it, the device mode gives them tensors
    monkeypatch.setenv("FAKE_NEURON_TMP", str(tmp_path))
    runs = neuron_probe.artifact_probes(neuron_probe.Budget(), tmp_path / "probe")
    first, moved = runs
    assert "error" not in first and "error" not in moved, (first, moved)
    assert moved["torch_neuronx_file"].startswith(str(tmp_path / "probe" / "moved-site"))  # imported from there
    answers = neuron_probe.artifact_answers(runs)
    assert answers["hlo_cache_dir_written"] is True and answers["hlo_cache_files"][0].endswith(".mlir")
    assert answers["debug_dir_written"] is True
    assert answers["debug_dir_same_layout_for_eager_and_compiled"] is True  # one job-based hierarchy
    assert any(p.endswith("/fx_graph.txt") for p in answers["debug_dir_after_eager_step"])
    assert answers["eager_keys_change_with_install_path"] is False
    assert answers["eager_step_compiles_again_from_another_install_path"] is False
    assert answers["versions"] == {"torch-neuronx": "2.13.3.0", "torch_neuronx.__version__": "2.13.3.0",
                                   "neuronx-cc": "2.28.7631.0", "neuronxcc.__version__": "2.28.7631.0"}
    assert answers["four_part_versions"] is True
    assert answers["cache_entry_bindings"] == {"_get_compilation_cache_entries": True, "_get_all_cache_keys": True}
    assert answers["cache_keys_follow_the_april_layout"] is True
    assert neuron_probe.answered_by(runs).startswith("the fake torch_neuronx of shapeplan/testing/fake_site")


@pytest.mark.slow
def test_the_device_report_answers_from_fresh_processes(tmp_path: Path) -> None:
    done = _run([SHAPEPLAN, "doctor", "--device", "neuron", "--report", "report.json"],
                fake_env("device", FAKE_NEURON_TMP=str(tmp_path)), tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    answers = report["answers"]
    assert answers["default_execution_mode"] == "async"  # the April tree's DEV build
    assert "TORCH_NEURONX_MLIR_ATEN_OPS" in answers["variables_set_by_import_torch"]
    assert answers["counters_move_with_metrics_off"] is False
    assert answers["async_first_run_compiles"] and answers["async_second_run_compiles_matmul"] is False
    assert answers["sdpa_512_compiles_again_in_a_fresh_process"] is True
    assert answers["compiled_graph_hits_across_processes"] is True
    assert answers["sync_mode_moves_counters"] is False and answers["sync_second_run_compiles_matmul"] is False
    # what shapeplan's own code relies on, against the fake as the source reads
    assert answers["set_enabled_after_metrics_were_read_off_counts"] is True
    assert answers["masked_sdpa_512_compiles_again_in_a_fresh_process"] is False  # the negative control
    assert answers["multi_op_repeat_compiles"] is False
    assert answers["multi_op_compiles_again_in_a_fresh_process"] is False
    assert answers["compiled_graph_hits_from_another_file_path"] is True  # the fake keys no source locations
    assert answers["race_each_kernel_compiled_once"] is True  # whichever process came second hit
    assert answers["race_a_miss_ended_as_a_hit"] in (True, False)  # only overlapping compiles show a miss end as a hit
    assert answers["device_count_by_core_setting"]["NEURON_RT_NUM_CORES=0"] == 4  # 0: every core
    assert answers["device_count_by_core_setting"]["NEURON_RT_NUM_CORES=1"] == 1
    created = sorted(f"{Path(d).parent.name}/{Path(d).name}" for d in answers["dirs_created_by_import_torch"])
    assert created == ["import/cache", "import/locks"]  # the two dirs the variables name
    assert answers["instance_type"] == "trn2.48xlarge"
    assert report["runs"]["async"][0]["shapeplan_settings"]["NEURON_LAUNCH_BLOCKING"] == "async"
    assert all(run["environment"]["NEURON_RT_VISIBLE_CORES"] == "0" for run in report["runs"]["async"])  # one core
    assert answers["layouts"]["sync"]["<64 hex>/<64 hex>.neff (sync mode's Python path)"] > 0
    assert answers["layouts"]["async"]["<64 hex>/<64 hex>.neff (sync mode's Python path)"] == 0
    assert report["package"]["found"]["TORCH_NEURONX_NEFF_CACHE_DIR"]
    # a real SFTTrainer loop on the device the Trainer picks: once per shape, and a fresh process finds the graphs
    assert answers["trl_first_padded_step_compiles"] and answers["trl_unpadded_new_length_compiles"]
    assert answers["trl_same_padded_shape_compiles_again"] is False
    assert answers["trl_padded_step_compiles_in_a_fresh_process"] is False
    steps = report["runs"]["trl_step"][0]["trl_steps"]
    assert steps["padded_128_device"] == "neuron:0"
    assert [s["input_ids"] for s in steps["padded_128"]] == [[2, 128], [2, 128]]
    short, long = sorted(s["input_ids"][1] for s in steps["unpadded"])
    assert long == 50 and short <= 40  # two lengths, so the second step met a new one
    # issue #56: each answer the report gives, and that the fake gave them
    assert answers["answered_by"].startswith("the fake torch_neuronx of shapeplan/testing/fake_site")
    assert "dev_neuron_devices" not in report["answers_from_fake"] and "layouts" in report["answers_from_fake"]
    assert answers["hlo_cache_dir_written"] is True and answers["debug_dir_same_layout_for_eager_and_compiled"]
    assert answers["eager_keys_change_with_install_path"] is False
    assert answers["versions"]["torch-neuronx"] == "2.13.3.0" and answers["four_part_versions"] is True
    assert answers["cache_entry_bindings"]["_get_compilation_cache_entries"] is True
    assert answers["cache_keys_follow_the_april_layout"] is True
