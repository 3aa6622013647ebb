"""Inductor (cpu/cuda): eager runs compile nothing; `torch.compile` caches FX graphs and AOTAutograd graphs
under TORCHINDUCTOR_CACHE_DIR, counted in `torch._dynamo.utils.counters`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ...adapters.host import installed_only

# (counter group, name) pairs read from torch._dynamo.utils.counters
COUNTERS = (
    ("inductor", "fxgraph_cache_miss"),
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_bypass"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_bypass"),
    ("stats", "unique_graphs"),
)
MISSES = ("fxgraph_cache_miss", "fxgraph_cache_bypass", "autograd_cache_miss", "autograd_cache_bypass")
HITS = ("fxgraph_cache_hit", "autograd_cache_hit")


def dynamo_settings(graphs: int) -> dict[str, bool | int]:
    """The dynamo settings warm-up and training must share: every planned shape is its own static graph.

    Automatic dynamic shapes would turn the second shape into a symbolic graph that neither matches the plan
    nor the cache, and the default recompile limit (8) would fall back to eager after 8 shapes.
    """
    import torch._dynamo

    return {"automatic_dynamic_shapes": False,
            "recompile_limit": max(graphs, int(torch._dynamo.config.recompile_limit))}


# The dynamo settings torch also reads from the environment (when torch._dynamo is first imported): `trl <method>`
# users, who cannot run a line of Python before training, need them as variables.
DYNAMO_ENVIRONMENT = {"automatic_dynamic_shapes": ("TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES", "0")}
DEFAULT_RECOMPILE_LIMIT = 8  # torch._dynamo.config.recompile_limit's default
# Inductor's FX graph and AOTAutograd caches, which warm switches on, as training must have them.
CACHE_ENVIRONMENT = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def dynamo_lines(graphs: int) -> list[str]:
    """What a `torch_compile` run must set to hit the graphs warmed here: the `export` lines of the settings torch
    reads from the environment, then every setting as the training script's Python line (the recompile limit only
    above torch's default, which holds as many graphs without a line)."""
    settings = dynamo_settings(graphs)
    exports = [f"export {name}={value}" for key, (name, value) in DYNAMO_ENVIRONMENT.items()
               if settings.get(key) is False]
    return [*exports, *(f"torch._dynamo.config.{name} = {value!r}" for name, value in settings.items()
                        if name != "recompile_limit" or value > DEFAULT_RECOMPILE_LIMIT)]


def python_only(lines: list[str] | tuple[str, ...]) -> list[str]:
    """The training-script lines of `lines` that no `export` line among them sets."""
    exported = {line.removeprefix("export ").partition("=")[0] for line in lines if line.startswith("export ")}
    covered = {f"torch._dynamo.config.{key} " for key, (name, _) in DYNAMO_ENVIRONMENT.items() if name in exported}
    return [line for line in lines
            if not line.startswith("export ") and not any(line.startswith(prefix) for prefix in covered)]


def apply_dynamo_settings(graphs: int) -> None:
    import torch._dynamo

    for name, value in dynamo_settings(graphs).items():
        setattr(torch._dynamo.config, name, value)


class InductorBackend:
    name = "inductor"

    def __init__(self, device: str) -> None:
        self.device = device

    def prepare(self, cache_dir: Path, *, scratch: Path | None = None) -> None:
        # Inductor keeps its locks and build files under its cache dir: `scratch` adds nothing
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)

    def configure(self, *, torch_compile: bool, graphs: int) -> None:
        import torch._functorch.config
        import torch._inductor.config

        torch._inductor.config.fx_graph_cache = True
        torch._functorch.config.enable_autograd_cache = True
        if torch_compile:
            apply_dynamo_settings(graphs)

    def compiles(self, *, torch_compile: bool) -> bool:
        return torch_compile

    def counters(self) -> dict[str, int]:
        from torch._dynamo.utils import counters

        return {name: int(counters[group][name]) for group, name in COUNTERS}

    def compiled(self, delta: Mapping[str, int]) -> bool:
        return any(delta.get(name, 0) > 0 for name in MISSES)

    def hit(self, delta: Mapping[str, int]) -> bool:
        return any(delta.get(name, 0) > 0 for name in HITS)

    def settings(self) -> dict[str, str]:
        import torch

        out = {"backend": "inductor", "device": self.device, "torch": torch.__version__}
        if self.device == "cuda" and torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
        out.update(installed_only(("triton",)))
        return out

    def script_lines(self, cache_dir: Path, *, torch_compile: bool, graphs: int) -> tuple[str, ...]:
        if not torch_compile:
            return ()
        lines = [f"export TORCHINDUCTOR_CACHE_DIR={cache_dir}"]
        lines += [f"export {name}={value}" for name, value in CACHE_ENVIRONMENT.items()]
        if self.device == "cpu":
            import torch

            # Inductor generates CPU kernels for the process's thread count, which is in their cache key, and
            # `accelerate launch` (which `trl <method>` runs through) sets OMP_NUM_THREADS=1 where it is unset:
            # measured, a `trl sft` run after a warm-up recompiled every graph until given the warm-up's count
            lines.append(f"export OMP_NUM_THREADS={torch.get_num_threads()}")
        return (*lines, *dynamo_lines(graphs))
