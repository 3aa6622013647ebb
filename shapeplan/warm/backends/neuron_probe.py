"""`shapeplan doctor --device neuron --report FILE`: what no source settles about the installed TorchNeuron, and
what shapeplan's own code relies on, measured in fresh processes and written as one JSON report a user can attach
to a bug report (research/neuron-audit.md).

Each probe is a child process (`python -m shapeplan.warm.backends.neuron_probe KIND CACHE OUT [ARG]`) pinned to one
NeuronCore (NEURON_RT_VISIBLE_CORES=0) unless it probes the cores, which writes its answers to the file OUT (never
parsed from stdout). The whole report keeps within TOTAL_BUDGET_S: each child gets what is left (at most
CHILD_TIMEOUT_S), and a probe that no longer fits is recorded as skipped. The probes, most telling first:
- `steps` in async mode (NEURON_LAUNCH_BLOCKING=0) and in sync mode (=1), twice each on one cache dir: a matmul, an
  SDPA at seq 512 without a mask (the NKI flash-attention kernel) and with one (the negative control), a multi-op
  step run twice (does op concatenation change the NEFF set?) and a tiny `torch.compile` graph, with both counter
  sources read after each step, the full compiler environment and shapeplan's own `settings()`;
- the default mode with metrics off, then, in the same process, switched on by `set_enabled(True)` after they were
  read off (what the guard does);
- two processes racing for one new graph on one cache dir (a miss, then a hit under the lock?);
- one compiled graph run from two file paths on one cache dir (do graph keys hold source paths?);
- NEURON_RT_NUM_CORES 0 and 1 and NEURON_RT_VISIBLE_CORES as a comma list, each with the runtime's device_count,
  the first with a cache and a lock dir that do not exist yet (what `import torch` creates on disk).
- one real TRL step loop (`SFTTrainer.train`, on the device the Trainer picks) on a tiny random Qwen3 built in the
  process, two steps padded to 128 (one shape) and two unpadded (two lengths), in two processes on one cache dir:
  does a step compile once per shape, and does a fresh process find the first one's graphs (what `warm` relies on)?
- what Neuron 2.34 changed (issue #56), right after the two modes: one eager step and one compiled step with
  TORCH_NEURONX_DEBUG_DIR and TORCH_NEURONX_HLO_CACHE_DIR set (what each dir holds after each step: one job-based
  hierarchy for both, or another layout per op?), then the same steps in a second process that imports torch and
  torch-neuronx from another path (a folder of links to their site dirs) on the same NEFF cache dir: do eager keys
  hold the install path? Every probe also records the four-part versions of torch-neuronx and neuronx-cc, whether
  `_C._get_compilation_cache_entries` and `_C._get_all_cache_keys` exist, and the keys each step added.
Then the host's /dev/neuron* and instance type, the files each mode wrote (which layouts) and a search of the
installed package for the names shapeplan relies on. `answers` sums it up, and says whether a fake torch_neuronx
(shapeplan's tests') gave them; every raw measurement stays in the report.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import counter_delta

CHILD_TIMEOUT_S = 240  # a first NEFF compile takes about a minute
TOTAL_BUDGET_S = 14 * 60  # the whole report, every probe included: under the 15 minutes `doctor --help` promises
ONE_CORE = "0"  # each probe's own NeuronCore: a child left to the default reserves every core
# Names shapeplan reads in the installed package (variables, counters, the stats call) and what decides the keys.
NAMES = ("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "TORCH_NEURONX_METRICS_ENABLED",
         "NEURON_LAUNCH_BLOCKING", "_get_compilation_cache_stats", "CompilationCache.TotalCompilations",
         "CompilationCache.PersistentHits", "CompilationCache.PersistentMisses", "set_enabled", "hash(tensor_info)",
         "DEFAULT_SYNC_MODE", "BUILD_TYPE", "/tmp/neff_cache", "/tmp/local_cache", "_get_platform_target",
         "TORCH_NEURONX_NEFF_DISABLE_CACHE", "TORCH_NEURONX_DISABLE_NEFF_CACHE", "TORCH_NEURONX_ENABLE_CONCATENATION",
         "_get_instance_type", "_get_compilation_cache_entries", "_get_all_cache_keys", "TORCH_NEURONX_HLO_CACHE_DIR",
         "TORCH_NEURONX_HLO_COMPILE_CACHE", "TORCH_NEURONX_DEBUG_DIR", "/tmp/neuron_backend",
         "TORCH_NEURONX_DYNAMO_BACKEND_ONLY")
# The answers a fake torch_neuronx does not give: what the host itself shows.
HOST_ANSWERS = ("dev_neuron_devices",)
# The source of the graph run from two paths: its code object's file is what the FX stack traces name.
GRAPH_SOURCE = "import torch\n\n\ndef work(t):\n    return torch.cos(t) * 3 - 1\n"
LAYOUTS = {"ab/cd/<32 hex>.neff (C++ cache)": re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{32}\.neff"),
           "<64 hex>/<64 hex>.neff (sync mode's Python path)": re.compile(r"([0-9a-f]{64})/\1\.neff")}
MAX_SEARCHED_BYTES = 512 * 1024 ** 2  # the package's files searched, in all


class Budget:
    """The seconds left of TOTAL_BUDGET_S: what each child may take."""

    def __init__(self, total: float = TOTAL_BUDGET_S) -> None:
        self.deadline = time.monotonic() + total

    def child_timeout(self) -> float:
        return min(CHILD_TIMEOUT_S, self.deadline - time.monotonic())


def probe(folder: Path, budget: Budget | None = None) -> dict[str, Any]:
    """Every probe, run in fresh processes over cache dirs under `folder`; the report."""
    budget = budget or Budget()
    runs: dict[str, Any] = {}
    layouts: dict[str, Any] = {}
    metrics_on = {"TORCH_NEURONX_METRICS_ENABLED": "1"}
    for mode, blocking in (("async", "0"), ("sync", "1")):
        cache = folder / mode
        runs[mode] = [_child(budget, "steps", cache, {"NEURON_LAUNCH_BLOCKING": blocking, **metrics_on})
                      for _ in range(2)]
        layouts[mode] = _layouts(cache)
    runs["artifacts"] = artifact_probes(budget, folder / "artifacts")
    # then switched on by set_enabled(True) after they were read off, in the same process (the guard's path)
    runs["default_metrics_off"] = [_child(budget, "switch", folder / "default",
                                          {"TORCH_NEURONX_METRICS_ENABLED": None})]
    runs["race"] = _race(budget, folder / "race", metrics_on)
    graph_dirs = [folder / "path-a", folder / "elsewhere" / "path-b"]
    for where in graph_dirs:
        where.mkdir(parents=True)
        (where / "graph.py").write_text(GRAPH_SOURCE, encoding="utf-8")
    runs["graph_two_paths"] = [_child(budget, "graph", folder / "graphs", metrics_on, str(where / "graph.py"))
                               for where in graph_dirs]
    # the first also names a cache and a lock dir that do not exist yet: does the import create them? (TorchNeuron's
    # defaults are watched in every probe)
    runs["cores"] = {name: _child(budget, "cores", cache, env, pin=False) for name, cache, env in (
        ("NEURON_RT_NUM_CORES=0", folder / "import" / "cache", {
            "NEURON_RT_NUM_CORES": "0", "NEURON_RT_VISIBLE_CORES": None,
            "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR": str(folder / "import" / "locks")}),
        ("NEURON_RT_NUM_CORES=1", folder / "cores", {"NEURON_RT_NUM_CORES": "1", "NEURON_RT_VISIBLE_CORES": None}),
        ("NEURON_RT_VISIBLE_CORES=0,1", folder / "cores", {"NEURON_RT_VISIBLE_CORES": "0,1",
                                                            "NEURON_RT_NUM_CORES": None}))}
    runs["trl_step"] = [_child(budget, "trl_step", folder / "trl", metrics_on) for _ in range(2)]
    report: dict[str, Any] = {"schema": 2, "python": sys.version.split()[0], "host": host(),
                              "package": search_package(), "runs": runs, "layouts": layouts, "budget_s": TOTAL_BUDGET_S}
    report["answers"] = answers(report)
    if report["answers"]["answered_by"].startswith("the fake"):
        report["answers_from_fake"] = sorted(k for k in report["answers"] if k not in HOST_ANSWERS)
    return report


def artifact_probes(budget: Budget, folder: Path) -> list[dict[str, Any]]:
    """One eager and one compiled step with the debug and HLO cache dirs set, then the same in a process that imports
    torch and torch-neuronx from another path, on the same NEFF cache dir."""
    cache = folder / "neff"
    first = _child(budget, "artifacts", cache, _artifact_env(folder / "first"))
    moved = _moved_site(folder / "moved-site")
    env = {**_artifact_env(folder / "moved"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(moved), os.environ.get("PYTHONPATH")]))}
    return [first, _child(budget, "artifacts", cache, env)]


def _artifact_env(folder: Path) -> dict[str, str | None]:
    return {"TORCH_NEURONX_METRICS_ENABLED": "1", "TORCH_NEURONX_DEBUG_DIR": str(folder / "debug"),
            "TORCH_NEURONX_HLO_CACHE_DIR": str(folder / "hlo")}


def _moved_site(folder: Path) -> Path:
    """A folder of links to every entry of the site dirs torch and torch-neuronx are installed in: put first on the
    path, it makes them import from another path (Python keeps the linked path in every module's file)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("torch_neuronx", "torch"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for entry in Path(next(iter(spec.submodule_search_locations))).parent.iterdir():
            link = folder / entry.name
            if not link.exists() and not link.is_symlink():
                link.symlink_to(entry)
    return folder


def host() -> dict[str, Any]:
    """The Neuron devices and the instance type, as the host and the runtime tell them."""
    from .neuron import INSTANCE_TYPE_FILE, neuron_devices

    try:
        instance = INSTANCE_TYPE_FILE.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        instance = None
    return {"dev_neuron_devices": neuron_devices(), "instance_type_dmi": instance}


def _environ(env: Mapping[str, str | None], cache: Path, *, pin: bool) -> dict[str, str]:
    """This process's environment with the cache dir, one pinned core (unless `pin` is off), then `env` (None: the
    variable unset)."""
    environ = {**os.environ, "TORCH_NEURONX_NEFF_CACHE_DIR": str(cache)}
    if pin:
        environ["NEURON_RT_VISIBLE_CORES"] = ONE_CORE
        environ.pop("NEURON_RT_NUM_CORES", None)
    for name, value in env.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return environ


def _command(kind: str, cache: Path, out: Path, arg: str | None) -> list[str]:
    return [sys.executable, "-m", "shapeplan.warm.backends.neuron_probe", kind, str(cache), str(out),
            *([arg] if arg else [])]


def _child(budget: Budget, kind: str, cache: Path, env: Mapping[str, str | None], arg: str | None = None, *,
           pin: bool = True) -> dict[str, Any]:
    timeout = budget.child_timeout()
    if timeout < 5:
        return {"error": f"skipped: the report's {TOTAL_BUDGET_S} s budget was spent"}
    with tempfile.NamedTemporaryFile(prefix="shapeplan-probe-", suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    started = time.monotonic()
    try:
        done = subprocess.run(_command(kind, cache, out, arg), env=_environ(env, cache, pin=pin),
                              capture_output=True, text=True, timeout=timeout, check=False)
        return _result(out, done.returncode, done.stderr, started)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {round(timeout)} s"}
    finally:
        out.unlink(missing_ok=True)


def _result(out: Path, code: int, stderr: str, started: float) -> dict[str, Any]:
    try:
        result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"error": f"exit {code}: {(stderr.strip().splitlines() or ['no output'])[-1]}",
                "stderr_tail": stderr[-4000:]}
    result["seconds"] = round(time.monotonic() - started, 1)
    result["stderr_tail"] = stderr[-2000:]
    return result


def _race(budget: Budget, cache: Path, env: Mapping[str, str | None]) -> list[dict[str, Any]]:
    """Two processes meet one new graph at once on one cache dir, each on its own core."""
    timeout = budget.child_timeout()
    if timeout < 5:
        return [{"error": f"skipped: the report's {TOTAL_BUDGET_S} s budget was spent"}]
    outs = [Path(tempfile.mkstemp(prefix="shapeplan-probe-", suffix=".json")[1]) for _ in range(2)]
    started = time.monotonic()
    children = [subprocess.Popen(_command("race", cache, out, None), env={
        **_environ(env, cache, pin=False), "NEURON_RT_VISIBLE_CORES": str(core)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True) for core, out in enumerate(outs)]
    results = []
    for process, out in zip(children, outs, strict=True):
        try:
            stderr = process.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))[1]
            results.append(_result(out, process.returncode, stderr, started))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            results.append({"error": f"did not finish in {round(timeout)} s"})
        finally:
            out.unlink(missing_ok=True)
    return results


def child(kind: str, cache: Path, arg: str | None = None) -> dict[str, Any]:
    """One probe process: the environment around `import torch`, then what `kind` measures."""
    tmp_before = _tmp_entries() if kind == "artifacts" else set()
    watched = _watched_dirs()
    existed = {str(p): p.exists() for p in watched}
    before_import = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NEURONX_", "NEURON_"))}
    import torch

    after_import = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NEURONX_", "NEURON_"))}
    out: dict[str, Any] = {
        "set_by_import": {k: v for k, v in after_import.items() if before_import.get(k) != v},
        "torch_neuronx_loaded_by_import_torch": "torch_neuronx" in sys.modules,
        "created_by_import": sorted(str(p) for p in watched if not existed[str(p)] and p.exists()),
        "environment": after_import,
    }
    import torch_neuronx

    from .neuron import ALL_KEYS, ENTRIES

    runtime = getattr(torch_neuronx, "_C", None)
    out["runtime"] = {name: _call(runtime, name) for name in (
        "_get_platform_target", "_get_logical_neuron_cores", "_get_instance_type")}
    out["fake"] = getattr(torch_neuronx, "__shapeplan_fake__", None)
    out["torch_neuronx_file"] = getattr(torch_neuronx, "__file__", None)
    out["versions"] = _versions(torch_neuronx)
    out["bindings"] = {name: hasattr(runtime, name) for name in (ENTRIES, ALL_KEYS)}
    out["device_count"] = _call(getattr(torch, "neuron", None), "device_count")
    if kind == "cores":
        return out
    try:
        metrics: Any = importlib.import_module("torch_neuronx.metrics")
    except ImportError:
        metrics = None
    out["metrics_enabled"] = _call(metrics, "is_enabled")
    steps: dict[str, Any] = {}
    step_keys: dict[str, Any] = {}

    def measure(name: str, work: Any) -> None:
        before = _counters(torch, runtime, metrics, cache)
        held = _keys(runtime)
        try:
            work()
            torch.neuron.synchronize()  # type: ignore[attr-defined]  # registered by torch-neuronx
        except Exception as exc:  # a probe reports what failed and goes on
            steps[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            return
        steps[name] = counter_delta(before, _counters(torch, runtime, metrics, cache))
        if held is not None:  # the keys the step added, with their compile milliseconds (0: loaded)
            added = [(k, v) for k, v in (_keys(runtime) or {}).items() if k not in held]
            step_keys[name] = dict(added[:20])

    x = torch.ones((4, 128), device="neuron")
    if kind == "race":
        measure("matmul", lambda: float((x @ x.T * 5).sum().cpu()))
    elif kind == "switch":  # metrics off, read so at the first op; then switched on, as the guard does
        _steps(torch, x, measure)
        if metrics is not None and hasattr(metrics, "set_enabled"):
            metrics.set_enabled(True)
        out["metrics_enabled_after_set_enabled"] = _call(metrics, "is_enabled")
        measure("add_after_set_enabled", lambda: float((x + 7).sum().cpu()))
    elif kind == "trl_step":
        with tempfile.TemporaryDirectory(prefix="shapeplan-probe-trl-") as scratch:
            out["trl_steps"] = _trl_steps(torch, lambda: _counters(torch, runtime, metrics, cache), Path(scratch))
    elif kind == "artifacts":  # what the debug and HLO cache dirs hold after one eager and one compiled step
        debug, hlo = (Path(os.environ[k]) for k in ("TORCH_NEURONX_DEBUG_DIR", "TORCH_NEURONX_HLO_CACHE_DIR"))
        seen = _tree(debug)
        y = torch.ones((4, 160), device="neuron")
        measure("eager", lambda: float((y @ y.T).sum().cpu()))
        out["debug_after_eager"], seen = sorted(_tree(debug) - seen)[:60], _tree(debug)
        graph = torch.compile(lambda t: torch.cos(t) * 2 - 1, backend="neuron", dynamic=False)
        measure("compiled", lambda: float(graph(y).sum().cpu()))
        out["debug_after_compiled"] = sorted(_tree(debug) - seen)[:60]
        out["hlo_cache_files"] = sorted(_tree(hlo))[:60]
        out["new_in_tmp"] = sorted(_tmp_entries() - tmp_before)[:60]
    elif kind == "graph":
        import runpy

        work = runpy.run_path(str(arg))["work"]
        graph = torch.compile(work, backend="neuron", dynamic=False)
        measure("compiled_graph", lambda: float(graph(x).sum().cpu()))
    else:
        _steps(torch, x, measure)
        from .neuron import NeuronBackend

        try:
            out["shapeplan_settings"] = NeuronBackend().settings()
        except Exception as exc:  # a probe reports what failed and goes on
            out["shapeplan_settings"] = f"error: {type(exc).__name__}: {exc}"[:300]
    out["steps"] = steps
    out["step_keys"] = step_keys
    out["stats_keys"] = sorted(_call(runtime, "_get_compilation_cache_stats") or {})
    return out


def _versions(torch_neuronx: Any) -> dict[str, Any]:
    """The installed distributions' versions of torch-neuronx and neuronx-cc, and what their modules say."""
    from ...adapters.host import installed_versions

    out: dict[str, Any] = dict(installed_versions(("torch-neuronx", "neuronx-cc")))
    out["torch_neuronx.__version__"] = getattr(torch_neuronx, "__version__", None)
    try:
        out["neuronxcc.__version__"] = getattr(importlib.import_module("neuronxcc"), "__version__", None)
    except ImportError:
        out["neuronxcc.__version__"] = None
    return out


def _keys(runtime: Any) -> dict[str, Any] | None:
    """The in-process compile cache's keys with their compile milliseconds, where the bindings exist."""
    from .neuron import ALL_KEYS, ENTRIES

    entries = _call(runtime, ENTRIES)
    if isinstance(entries, list):
        return {str(e.get("cache_key")): e.get("compilation_time_ms") for e in entries if isinstance(e, dict)}
    keys = _call(runtime, ALL_KEYS)
    return dict.fromkeys(map(str, keys)) if isinstance(keys, (set, list, frozenset)) else None


def _tree(root: Path) -> set[str]:
    """The files and folders under `root`, as relative paths (six levels at most)."""
    if not root.is_dir():
        return set()
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if len(p.relative_to(root).parts) <= 6}


def _tmp_entries() -> set[str]:
    """The names the temp dirs hold at their top: where an HLO cache without a dir of its own might go."""
    out: set[str] = set()
    for folder in dict.fromkeys([Path("/tmp"), Path(tempfile.gettempdir())]):
        with contextlib.suppress(OSError):
            out.update(str(folder / name) for name in os.listdir(folder))
    return out


def _steps(torch: Any, x: Any, measure: Any) -> None:
    q = torch.ones((1, 2, 512, 64), device="neuron")
    mask = torch.ones((512, 512), dtype=torch.bool, device="neuron").tril()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    measure("matmul", lambda: float((x @ x.T).sum().cpu()))
    measure("sdpa_512", lambda: float(sdpa(q, q, q, is_causal=True).sum().cpu()))
    measure("sdpa_512_masked", lambda: float(sdpa(q, q, q, attn_mask=mask).sum().cpu()))

    def multi_op() -> None:  # several small ops queued back to back: what Adaptive Eager could fuse
        y = torch.tanh(x * 3 + 1) - x / 2
        float(torch.relu(y @ y.T).mean().cpu())

    measure("multi_op", multi_op)
    measure("multi_op_repeat", multi_op)
    graph = torch.compile(lambda t: torch.sin(t) * 2 + 1, backend="neuron", dynamic=False)
    measure("compiled_graph", lambda: float(graph(x).sum().cpu()))


# The rows of the TRL probe, two batches of two in the sampler's order: unpadded, the batch holding the 50 is 50 long
# and the other at most 40, whatever the order; padded to 128 both are one shape.
TRL_ROWS = (20, 30, 40, 50)


def _trl_steps(torch: Any, counters: Any, scratch: Path) -> dict[str, Any]:
    """`SFTTrainer.train` for two steps padded to a multiple of 128 and two unpadded, each step's input shape and
    counter change; the model and tokenizer are random and tiny, built here (no download)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, 64)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<eos>")),
                                        pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         pad_token_id=0, eos_token_id=1))
    rows = Dataset.from_list([{"input_ids": [2 + i % 60 for i in range(n)]} for n in TRL_ROWS])
    runs: dict[str, Any] = {}

    class Measure(TrainerCallback):
        def __init__(self, steps: list[dict[str, Any]]) -> None:
            self.steps = steps
            self.before: dict[str, int] = {}

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.before = counters()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.steps[-1]["counters"] = counter_delta(self.before, counters())

    for name, multiple in (("padded_128", 128), ("unpadded", None)):
        steps: list[dict[str, Any]] = []
        runs[name] = steps
        config = SFTConfig(output_dir=str(scratch / "trl-output"), per_device_train_batch_size=2, max_steps=2,
                           pad_to_multiple_of=multiple, report_to=[], save_strategy="no", logging_strategy="no",
                           disable_tqdm=True, dataloader_num_workers=0)
        trainer = SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer,
                             callbacks=[Measure(steps)])
        hook = model.register_forward_pre_hook(
            lambda _module, _args, kwargs, steps=steps: steps.append({"input_ids": list(kwargs["input_ids"].shape)}),
            with_kwargs=True)
        try:
            trainer.train()
        except Exception as exc:  # a probe reports what failed and goes on
            runs[name] = {"error": f"{type(exc).__name__}: {exc}"[:500], "steps": steps}
        hook.remove()
        runs[f"{name}_device"] = str(trainer.args.device)
    return runs


def _watched_dirs() -> list[Path]:
    """The dirs `import torch` may create: TorchNeuron's defaults and what the environment names."""
    from .neuron import DEFAULT_CACHE_DIR, DEFAULT_LOCK_DIR

    named = [os.environ.get(k) for k in ("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR")]
    return [DEFAULT_CACHE_DIR, DEFAULT_LOCK_DIR, *(Path(p) for p in named if p)]


def _call(owner: Any, name: str) -> Any:
    function = getattr(owner, name, None)
    if function is None:
        return None
    try:
        return function()
    except Exception as exc:  # a probe reports what failed and goes on
        return f"error: {type(exc).__name__}: {exc}"[:300]


def _counters(torch: Any, runtime: Any, metrics: Any, cache: Path) -> dict[str, int]:
    torch.neuron.synchronize()
    out: dict[str, int] = {}
    stats = _call(runtime, "_get_compilation_cache_stats")
    if isinstance(stats, dict):
        out.update((f"stats.{k}", int(v)) for k, v in stats.items()  # counters, not sizes or entry counts
                   if isinstance(v, int) and not isinstance(v, bool) and k.endswith(("hits", "misses", "compilations")))
    if metrics is not None:
        for name in _call(metrics, "get_counter_names") or ():
            value = metrics.get_counter_value(name)
            if isinstance(value, int):
                out[f"metrics.{name}"] = value
    out["neff_files"] = sum(1 for _ in cache.rglob("*.neff")) if cache.is_dir() else 0
    return out


def _layouts(cache: Path) -> dict[str, Any]:
    files = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()) if cache.is_dir() else []
    counted = {name: sum(1 for f in files if pattern.fullmatch(f)) for name, pattern in LAYOUTS.items()}
    other = [f for f in files if not any(pattern.fullmatch(f) for pattern in LAYOUTS.values())]
    return {**counted, "other": other[:50], "files": len(files)}


def search_package() -> dict[str, Any]:
    """Which NAMES the installed torch_neuronx holds, in which files (its sources and its compiled libraries)."""
    spec = importlib.util.find_spec("torch_neuronx")
    if spec is None or not spec.submodule_search_locations:
        return {"location": None}
    root = Path(next(iter(spec.submodule_search_locations)))
    found: dict[str, list[str]] = {name: [] for name in NAMES}
    searched = 0
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.suffix not in (".py", ".so", ".txt", ".json", ".cfg") or \
                searched + path.stat().st_size > MAX_SEARCHED_BYTES:
            continue
        data = path.read_bytes()
        searched += len(data)
        for name in NAMES:
            if name.encode() in data:
                found[name].append(path.relative_to(root).as_posix())
    build = root / "_build_config.py"
    return {"location": str(root), "found": found, "searched_bytes": searched,
            "build_config": build.read_text(encoding="utf-8", errors="replace")[:2000] if build.is_file() else None}


def answers(report: Mapping[str, Any]) -> dict[str, Any]:
    """The questions of the audit, answered from the raw runs (None: the runs do not tell)."""
    runs = report["runs"]

    def step(mode: str, run: int, name: str) -> dict[str, int] | None:
        value = (runs[mode][run] if len(runs[mode]) > run else {}).get("steps", {}).get(name)
        return value if isinstance(value, dict) and "error" not in value else None

    def compiled(delta: dict[str, int] | None) -> bool | None:
        return None if delta is None else _compiled(delta)

    def moved(delta: dict[str, int] | None) -> bool | None:
        return None if delta is None else any(v > 0 for k, v in delta.items() if k != "neff_files")

    default = runs["default_metrics_off"][0]
    race = [step("race", i, "matmul") for i in range(2)]
    cores = {name: result.get("device_count") if "error" not in result else result["error"]
             for name, result in runs["cores"].items()}
    imported = runs["cores"]["NEURON_RT_NUM_CORES=0"]
    return {
        "default_execution_mode": {"1": "sync", "0": "async"}.get(
            str(default.get("set_by_import", {}).get("NEURON_LAUNCH_BLOCKING")), "not set by import"),
        "variables_set_by_import_torch": sorted(default.get("set_by_import", {})),
        "counters_move_with_metrics_off": moved(step("default_metrics_off", 0, "matmul")),
        "set_enabled_after_metrics_were_read_off_counts": moved(step("default_metrics_off", 0,
                                                                     "add_after_set_enabled")),
        "async_first_run_compiles": compiled(step("async", 0, "matmul")),
        "async_second_run_compiles_matmul": compiled(step("async", 1, "matmul")),
        "sdpa_512_compiles_again_in_a_fresh_process": compiled(step("async", 1, "sdpa_512")),
        "masked_sdpa_512_compiles_again_in_a_fresh_process": compiled(step("async", 1, "sdpa_512_masked")),
        "multi_op_repeat_compiles": compiled(step("async", 0, "multi_op_repeat")),
        "multi_op_compiles_again_in_a_fresh_process": compiled(step("async", 1, "multi_op")),
        "compiled_graph_hits_across_processes": None if step("async", 1, "compiled_graph") is None else
        not compiled(step("async", 1, "compiled_graph")),
        "compiled_graph_hits_from_another_file_path": None if step("graph_two_paths", 1, "compiled_graph") is None
        else not compiled(step("graph_two_paths", 1, "compiled_graph")),
        **_race_answers(race),
        "sync_mode_moves_counters": moved(step("sync", 0, "matmul")),
        "sync_second_run_compiles_matmul": compiled(step("sync", 1, "matmul")),
        "device_count_by_core_setting": cores,
        "comma_list_cores_accepted": None if not isinstance(cores.get("NEURON_RT_VISIBLE_CORES=0,1"), int) else
        cores["NEURON_RT_VISIBLE_CORES=0,1"] == 2,
        "dirs_created_by_import_torch": imported.get("created_by_import"),
        "dev_neuron_devices": report["host"]["dev_neuron_devices"],
        "instance_type": (imported.get("runtime") or {}).get("_get_instance_type") or
        report["host"]["instance_type_dmi"],
        **_trl_answers(runs.get("trl_step") or []),
        "layouts": {mode: {k: v for k, v in found.items() if k not in ("other",)} for mode, found in
                    report["layouts"].items()},
        **artifact_answers(runs.get("artifacts") or []),
        "answered_by": answered_by(_results(runs)),
    }


def _results(runs: Any) -> list[dict[str, Any]]:
    """Every child's result in `runs`, however nested."""
    if isinstance(runs, dict):
        return [runs] if "fake" in runs or "error" in runs else [r for v in runs.values() for r in _results(v)]
    return [r for v in runs for r in _results(v)] if isinstance(runs, list) else []


def answered_by(results: list[dict[str, Any]]) -> str:
    """Which torch_neuronx the children ran: a fake's answers show what shapeplan's tests assume, not a device."""
    fake = next((r["fake"] for r in results if r.get("fake")), None)
    if fake:
        return (f"the fake torch_neuronx of {fake}: every answer but {', '.join(HOST_ANSWERS)} shows what shapeplan's "
                "tests assume (the April source and the 2.34 docs as read), not what a device does")
    files = {r["torch_neuronx_file"] for r in results if r.get("torch_neuronx_file")}
    return f"torch-neuronx at {', '.join(sorted(files)) or 'an unknown path'}"


def _layout_of(paths: list[str]) -> set[str]:
    """Paths with their numbers and hashes made alike: the shape of a hierarchy, not its names."""
    return {re.sub(r"[0-9]+", "N", re.sub(r"[0-9a-f]{8,}", "H", p)) for p in paths}


def artifact_answers(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """From `artifact_probes`: the HLO cache and debug dirs after one eager and one compiled step, the eager keys from
    another install path, the four-part versions and the cache-entry bindings (None: not measured)."""
    from .neuron import key_parts

    first = runs[0] if runs and "error" not in runs[0] else {}
    moved = runs[1] if len(runs) > 1 and "error" not in runs[1] else {}
    eager, compiled = first.get("debug_after_eager"), first.get("debug_after_compiled")
    versions = first.get("versions") or {}
    keys = [k for step in (first.get("step_keys") or {}).values() for k in step]
    first_eager, moved_eager = ((r.get("step_keys") or {}).get("eager") for r in (first, moved))
    moved_step = (moved.get("steps") or {}).get("eager")
    return {
        "hlo_cache_dir_written": None if not first else bool(first.get("hlo_cache_files")),
        "hlo_cache_files": (first.get("hlo_cache_files") or [])[:10],
        "hlo_named_entries_new_in_tmp": [p for p in first.get("new_in_tmp") or [] if "hlo" in p.lower()],
        "debug_dir_written": None if eager is None else bool(eager or compiled),
        "debug_dir_after_eager_step": eager,
        "debug_dir_after_compiled_step": compiled,
        "debug_dir_same_layout_for_eager_and_compiled": None if not eager or not compiled else
        _layout_of(eager) == _layout_of(compiled),
        # the second process's own eager keys: those it loaded from the first one's NEFFs keep their key
        "eager_keys_change_with_install_path": None if first_eager is None or moved_eager is None else
        set(first_eager) != set(moved_eager),
        "eager_step_compiles_again_from_another_install_path": None if not isinstance(moved_step, dict) or
        "error" in moved_step else _compiled(moved_step),
        "versions": {k: versions.get(k) for k in ("torch-neuronx", "torch_neuronx.__version__", "neuronx-cc",
                                                  "neuronxcc.__version__")} if versions else None,
        "four_part_versions": None if not versions else all(
            isinstance(v, str) and len(re.findall(r"[0-9]+", v.split("+")[0])) >= 4 for v in versions.values()),
        "cache_entry_bindings": first.get("bindings"),
        "cache_keys_follow_the_april_layout": None if not keys else all("key" not in key_parts(k) for k in keys),
        "cache_keys_sample": keys[:5],
    }


def _compiled(delta: Mapping[str, int]) -> bool:
    """Whether a counter change shows a compile: either counter source, or a new NEFF file."""
    return any(v > 0 for k, v in delta.items() if k.endswith("TotalCompilations") or k in (
        "stats.total_compilations", "neff_files"))


def _trl_answers(runs: list[dict[str, Any]]) -> dict[str, bool | None]:
    """From the TRL step loop in two processes: a step compiles for a shape it has not met, and only then."""
    def steps(run: int, name: str) -> list[dict[str, int]] | None:
        found = (runs[run].get("trl_steps") or {}).get(name) if len(runs) > run else None
        if not isinstance(found, list) or len(found) != 2 or not all("counters" in s for s in found):
            return None
        return [s["counters"] for s in found]

    first, fresh, unpadded = steps(0, "padded_128"), steps(1, "padded_128"), steps(0, "unpadded")
    return {
        "trl_first_padded_step_compiles": None if first is None else _compiled(first[0]),
        "trl_same_padded_shape_compiles_again": None if first is None else _compiled(first[1]),
        "trl_unpadded_new_length_compiles": None if unpadded is None else _compiled(unpadded[1]),
        "trl_padded_step_compiles_in_a_fresh_process": None if fresh is None else _compiled(fresh[0]),
    }


def _race_answers(race: list[dict[str, int] | None]) -> dict[str, bool | None]:
    """From the racing processes' counters (one source: the stats call's, else the metrics'): whether each kernel
    compiled once in all (the other process hit), and whether a miss ended as a hit (it waited on the lock)."""
    if any(d is None for d in race):
        return {"race_each_kernel_compiled_once": None, "race_a_miss_ended_as_a_hit": None}

    def read(delta: dict[str, int], stats: str, metric: str) -> int:
        return delta.get(f"stats.{stats}", delta.get(f"metrics.CompilationCache.{metric}", 0))

    counts = [(read(d, "total_compilations", "TotalCompilations"), read(d, "persistent_hits", "PersistentHits"),
               read(d, "persistent_misses", "PersistentMisses")) for d in race if d is not None]
    kernels = max(c + h for c, h, _ in counts)
    return {"race_each_kernel_compiled_once": sum(c for c, _, _ in counts) == kernels,
            "race_a_miss_ended_as_a_hit": any(m > c for c, _, m in counts)}


def write_report(path: Path, versions: Mapping[str, str]) -> dict[str, Any]:
    """Run every probe and write the report, with the host's `versions`, to `path` atomically."""
    from ...plan.targets import write_output

    with tempfile.TemporaryDirectory(prefix="shapeplan-probe-") as folder:
        report = {"versions": dict(versions), **probe(Path(folder))}
    write_output(path, json.dumps(report, indent=2, sort_keys=True, default=str) + "\n", "--report")
    return report


if __name__ == "__main__":  # KIND CACHE OUT [ARG]: the answers go to the file OUT
    from ...plan.io import write_atomic

    write_atomic(Path(sys.argv[3]), json.dumps(child(sys.argv[1], Path(sys.argv[2]), *sys.argv[4:5]), default=str))
