"""The Neuron backend against FakeNeuron: lazy import after the environment is set, counters, manifest."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from shapeplan.cli import main
from shapeplan.errors import UsageError
from shapeplan.plan.model import Plan, PlanStats, Shape
from shapeplan.warm.backends import default_device, make_backend
from shapeplan.warm.backends.neuron import NeuronBackend
from shapeplan.warm.model import WarmTask
from shapeplan.warm.runner import MANIFEST, Tracker, environment_key, tasks_from_plan, warm
from tests.warm.fake_neuron import FakeNeuron


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
    assert fake.env_at_import == {"TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path), "TORCH_NEURONX_METRICS_ENABLED": "1"}
    fake.compile(2)
    fake.hit(1)
    after = backend.counters()
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert delta == {"persistent_misses": 2, "persistent_hits": 1, "CompilationCache.PersistentMisses": 2,
                     "CompilationCache.TotalCompilations": 2, "CompilationCache.PersistentHits": 1}
    assert backend.compiled(delta)
    assert not backend.compiled({"persistent_hits": 4, "CompilationCache.PersistentHits": 4})
    settings = backend.settings()
    assert settings["torch-neuronx"] == FakeNeuron.version
    assert settings["NEURON_CC_FLAGS"] == "--model-type=transformer"
    assert settings["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert backend.script_lines(tmp_path, torch_compile=False, graphs=3) == (
        f"export TORCH_NEURONX_NEFF_CACHE_DIR={tmp_path}", "export NEURON_CC_FLAGS=--model-type=transformer",
        "export NEURON_LOGICAL_NC_CONFIG=2")


class FakeWarmer:
    """Stands in for a method warmer: a shape compiles the first time the fake cache meets it."""

    torch_compile = False
    shares = None

    def __init__(self, fake: FakeNeuron, seen: set[str]) -> None:
        self.fake, self.seen = fake, seen
        self.warnings: list[str] = []

    def bind(self, plan: Plan) -> None:
        pass

    def tasks(self, plan: Plan) -> tuple[WarmTask, ...]:
        return tasks_from_plan(plan, eval_passes=1)

    def environment(self) -> dict[str, Any]:
        return {"method": "sft", "model": "tiny"}

    def run(self, tasks: Sequence[WarmTask], context: Sequence[WarmTask], tracker: Tracker) -> None:
        tracker.start()
        for task in tasks:
            if task.seq < 0:
                tracker.fail(task, "RuntimeError: boom")
                continue
            (self.fake.hit if task.key in self.seen else self.fake.compile)(1)
            self.seen.add(task.key)
            tracker.finish(task)


def _plan(*seqs: int) -> Plan:
    shapes = tuple(Shape(phase="train", batch=2, seq=s, count=1, first_step=1) for s in seqs)
    return Plan(method="sft", exact=True, pad_to_multiple_of=128, shapes=shapes,
                stats=PlanStats(rows=4, dropped_rows=0, micro_batches=len(seqs), optimizer_steps=len(seqs),
                                tokens=1, padded_tokens=1))


def test_warm_records_the_manifest_and_skips_what_it_holds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeNeuron().install(monkeypatch)
    backend = NeuronBackend()
    backend.prepare(tmp_path)
    seen: set[str] = set()
    first = warm(_plan(128, 256, -1), FakeWarmer(fake, seen), backend, tmp_path, progress=False)
    assert [(r.task.seq, r.status) for r in first.results] == [(128, "compiled"), (256, "compiled"), (-1, "failed")]
    assert first.results[0].counters["persistent_misses"] == 1

    manifest = json.loads((tmp_path / MANIFEST).read_text())
    (env_key, section), = manifest["environments"].items()
    assert env_key == environment_key(first.environment)
    assert section["environment"]["compiler"]["backend"] == "neuron"
    assert {k: v["status"] for k, v in section["shapes"].items()} == {
        "train 2x128": "compiled", "train 2x256": "compiled", "train 2x-1": "failed"}

    second = warm(_plan(128, 256, 384), FakeWarmer(fake, seen), backend, tmp_path, progress=False)
    assert [(r.task.seq, r.status) for r in second.results] == [(128, "skipped"), (256, "skipped"),
                                                                (384, "compiled")]
    verified = warm(_plan(128, 256, 384), FakeWarmer(fake, seen), backend, tmp_path, verify=True, progress=False)
    assert [r.status for r in verified.results] == ["cached", "cached", "cached"]
