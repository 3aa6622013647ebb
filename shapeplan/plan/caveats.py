"""The Trainium guide's known breakages, as warnings with their exact fix: from the plan's config and the
environment the run will have. Pure: `environ` is passed in."""

from __future__ import annotations

from collections.abc import Mapping

from .model import Plan

_TRAIN_SIDE = ("train", "eval")


def caveats(plan: Plan, environ: Mapping[str, str]) -> list[str]:
    # No caveat for cache_implementation static with a float32 model: transformers (5.x) allocates a static cache
    # layer from the first keys' and values' own dtypes (StaticLayer.lazy_initialization), and a float32 tiny Qwen3
    # generates with a static cache on CPU with and without bf16 autocast, as a real GRPO warm-up does.
    out = []
    config = plan.config
    train_shapes = {s.key for s in plan.shapes if s.phase in _TRAIN_SIDE}
    if config.get("torch_compile") and environ.get("TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES", "1") == "1" \
            and len(train_shapes) > 1:
        out.append(f"torch_compile with automatic dynamic shapes left on: at the second of {len(train_shapes)} "
                   "shapes dynamo compiles a dynamic graph, which Neuron cannot run (TRL #7660); fix: export "
                   "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0 (or torch._dynamo.config.automatic_dynamic_shapes = "
                   "False in the training script)")
    visible = environ.get("NEURON_RT_VISIBLE_CORES")
    if visible:
        cores = _cores(visible)
        if cores is None:
            out.append(f"NEURON_RT_VISIBLE_CORES={visible} is not a list of cores; fix: export "
                       "NEURON_RT_VISIBLE_CORES=0-1 (an aligned group such as 0,1 / 2,3 / 0-3)")
        elif not _aligned(cores):
            size = 1 << (len(cores) - 1).bit_length()
            group = "0" if size == 1 else f"0-{size - 1}"
            out.append(f"NEURON_RT_VISIBLE_CORES={visible} is not an aligned group: its cores cannot run collectives "
                       f"together (only groups of 2^k cores starting at a multiple of 2^k: 0,1 / 2,3 / 0-3, never "
                       f"1,2); fix: export NEURON_RT_VISIBLE_CORES={group}")
    return out


def _cores(value: str) -> list[int] | None:
    cores: list[int] = []
    try:
        for part in value.split(","):
            first, _, last = part.strip().partition("-")
            cores += range(int(first), int(last or first) + 1)
    except ValueError:
        return None
    return sorted(set(cores)) or None


def _aligned(cores: list[int]) -> bool:
    size = len(cores)
    return (size & (size - 1) == 0 and cores[0] % size == 0 and cores == list(range(cores[0], cores[0] + size)))
