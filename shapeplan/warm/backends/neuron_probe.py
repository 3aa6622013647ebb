"""`shapeplan doctor --device neuron --report FILE`: what no source settles about the installed TorchNeuron, measured
in fresh processes and written as one JSON report a user can attach to a bug report (research/neuron-audit.md,
"Cannot be verified from any stored source").

Each probe is a child process (`python -m shapeplan.warm.backends.neuron_probe MODE CACHE`) that records the
environment before and after `import torch`, then runs a matmul, an SDPA at seq 512 (the NKI flash-attention
kernel) and a tiny `torch.compile` graph, reading the compile counters of both sources after each step:
- in async mode (NEURON_LAUNCH_BLOCKING=0) and in sync mode (=1), twice each on one cache dir (the second run shows
  what a fresh process loads, and whether the SDPA's key survives a new process);
- in the default mode with metrics off (are the counters gated?) and with NEURON_RT_VISIBLE_CORES as a comma list.
Then the files each mode wrote (which layouts) and a search of the installed package for the names shapeplan relies
on. `answers` sums it up; every raw measurement stays in the report.
"""

from __future__ import annotations

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

CHILD_TIMEOUT_S = 240  # a first NEFF compile takes about a minute; four steps, the whole probe under 15 minutes
# Names shapeplan reads in the installed package (variables, counters, the stats call) and what decides the keys.
NAMES = ("TORCH_NEURONX_NEFF_CACHE_DIR", "TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "TORCH_NEURONX_METRICS_ENABLED",
         "NEURON_LAUNCH_BLOCKING", "_get_compilation_cache_stats", "CompilationCache.TotalCompilations",
         "CompilationCache.PersistentHits", "CompilationCache.PersistentMisses", "set_enabled", "hash(tensor_info)",
         "DEFAULT_SYNC_MODE", "BUILD_TYPE", "/tmp/neff_cache", "/tmp/local_cache", "_get_platform_target")
LAYOUTS = {"ab/cd/<32 hex>.neff (C++ cache)": re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{32}\.neff"),
           "<64 hex>/<64 hex>.neff (sync mode's Python path)": re.compile(r"([0-9a-f]{64})/\1\.neff")}
MAX_SEARCHED_BYTES = 512 * 1024 ** 2  # the package's files searched, in all


def probe(folder: Path) -> dict[str, Any]:
    """Every probe, run in fresh processes over cache dirs under `folder`; the report."""
    runs: dict[str, Any] = {}
    layouts: dict[str, Any] = {}
    for mode, blocking in (("async", "0"), ("sync", "1")):
        cache = folder / mode
        runs[mode] = [_child(cache, {"NEURON_LAUNCH_BLOCKING": blocking, "TORCH_NEURONX_METRICS_ENABLED": "1"})
                      for _ in range(2)]
        layouts[mode] = _layouts(cache)
    runs["default_metrics_off"] = [_child(folder / "default", {"TORCH_NEURONX_METRICS_ENABLED": None})]
    runs["comma_list_cores"] = [_child(folder / "comma", {"NEURON_RT_VISIBLE_CORES": "0,1",
                                                          "TORCH_NEURONX_METRICS_ENABLED": "1"})]
    report = {"schema": 1, "python": sys.version.split()[0], "package": search_package(), "runs": runs,
              "layouts": layouts}
    report["answers"] = answers(report)
    return report


def _child(cache: Path, env: Mapping[str, str | None]) -> dict[str, Any]:
    environ = {k: v for k, v in os.environ.items() if k not in env or env[k] is not None}
    environ.update({k: v for k, v in env.items() if v is not None})
    environ["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(cache)
    command = [sys.executable, "-m", "shapeplan.warm.backends.neuron_probe", str(cache)]
    started = time.monotonic()
    try:
        done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {CHILD_TIMEOUT_S} s"}
    lines = done.stdout.strip().splitlines()
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"error": f"exit {done.returncode}: {(done.stderr.strip().splitlines() or ['no output'])[-1]}",
                "stderr_tail": done.stderr[-4000:]}
    result["seconds"] = round(time.monotonic() - started, 1)
    result["stderr_tail"] = done.stderr[-2000:]
    return result


def child(cache: Path) -> dict[str, Any]:
    """One probe process: the environment around `import torch`, then each step's counter changes."""
    before_import = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NEURONX_", "NEURON_"))}
    import torch

    after_import = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NEURONX_", "NEURON_"))}
    out: dict[str, Any] = {
        "set_by_import": {k: v for k, v in after_import.items() if before_import.get(k) != v},
        "torch_neuronx_loaded_by_import_torch": "torch_neuronx" in sys.modules,
    }
    import torch_neuronx

    runtime = getattr(torch_neuronx, "_C", None)
    out["runtime"] = {name: _call(runtime, name) for name in ("_get_platform_target", "_get_logical_neuron_cores")}
    out["device_count"] = _call(getattr(torch, "neuron", None), "device_count")
    try:
        metrics: Any = importlib.import_module("torch_neuronx.metrics")
    except ImportError:
        metrics = None
    out["metrics_enabled"] = _call(metrics, "is_enabled")
    steps: dict[str, Any] = {}

    def measure(name: str, work: Any) -> None:
        before = _counters(torch, runtime, metrics, cache)
        try:
            work()
            torch.neuron.synchronize()  # type: ignore[attr-defined]  # registered by torch-neuronx
        except Exception as exc:  # a probe reports what failed and goes on
            steps[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            return
        steps[name] = counter_delta(before, _counters(torch, runtime, metrics, cache))

    x = torch.ones((4, 128), device="neuron")
    q = torch.ones((1, 2, 512, 64), device="neuron")
    measure("matmul", lambda: float((x @ x.T).sum().cpu()))
    measure("sdpa_512", lambda: float(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
                                      .sum().cpu()))
    graph = torch.compile(lambda t: torch.sin(t) * 2 + 1, backend="neuron", dynamic=False)
    measure("compiled_graph", lambda: float(graph(x).sum().cpu()))
    out["steps"] = steps
    out["stats_keys"] = sorted(_call(runtime, "_get_compilation_cache_stats") or {})
    return out


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
        if delta is None:
            return None
        return any(v > 0 for k, v in delta.items() if k.endswith("TotalCompilations") or k in (
            "stats.total_compilations", "neff_files"))

    default = runs["default_metrics_off"][0]
    off = step("default_metrics_off", 0, "matmul")
    return {
        "default_execution_mode": {"1": "sync", "0": "async"}.get(
            str(default.get("set_by_import", {}).get("NEURON_LAUNCH_BLOCKING")), "not set by import"),
        "variables_set_by_import_torch": sorted(default.get("set_by_import", {})),
        "counters_move_with_metrics_off": None if off is None else any(
            v > 0 for k, v in off.items() if k != "neff_files"),
        "async_first_run_compiles": compiled(step("async", 0, "matmul")),
        "async_second_run_compiles_matmul": compiled(step("async", 1, "matmul")),
        "sdpa_512_compiles_again_in_a_fresh_process": compiled(step("async", 1, "sdpa_512")),
        "compiled_graph_hits_across_processes": None if step("async", 1, "compiled_graph") is None else
        not compiled(step("async", 1, "compiled_graph")),
        "sync_mode_moves_counters": None if step("sync", 0, "matmul") is None else any(
            v > 0 for k, v in (step("sync", 0, "matmul") or {}).items() if k != "neff_files"),
        "sync_second_run_compiles_matmul": compiled(step("sync", 1, "matmul")),
        "comma_list_cores_accepted": None if not runs["comma_list_cores"] else
        "error" not in runs["comma_list_cores"][0] and step("comma_list_cores", 0, "matmul") is not None,
        "layouts": {mode: {k: v for k, v in found.items() if k not in ("other",)} for mode, found in
                    report["layouts"].items()},
    }


def write_report(path: Path, versions: Mapping[str, str]) -> dict[str, Any]:
    """Run every probe and write the report, with the host's `versions`, to `path` atomically."""
    from ...plan.targets import write_output

    with tempfile.TemporaryDirectory(prefix="shapeplan-probe-") as folder:
        report = {"versions": dict(versions), **probe(Path(folder))}
    write_output(path, json.dumps(report, indent=2, sort_keys=True, default=str) + "\n", "--report")
    return report


if __name__ == "__main__":
    print(json.dumps(child(Path(sys.argv[1])), default=str))
