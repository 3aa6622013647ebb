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


def dynamo_settings(graphs: int) -> dict[str, object]:
    """The dynamo settings warm-up and training must share: every planned shape is its own static graph.

    Automatic dynamic shapes would turn the second shape into a symbolic graph that neither matches the plan
    nor the cache, and the default recompile limit (8) would fall back to eager after 8 shapes.
    """
    import torch._dynamo

    return {"automatic_dynamic_shapes": False,
            "recompile_limit": max(graphs, int(torch._dynamo.config.recompile_limit))}


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
        lines += [f"torch._dynamo.config.{name} = {value!r}" for name, value in dynamo_settings(graphs).items()]
        return tuple(lines)
