"""The static key/value cache a run's `generate` calls hold on the device: what pinning its length costs in memory.

transformers keeps one static cache on the model and allocates a new one when a call needs another batch size or a
longer cache (`GenerationMixin._get_cache`), so the cache's peak is its largest batch x cache length over the run's
calls. Each token of it holds a key and a value per layer: 2 x layers x key/value heads x head_dim x the dtype's
bytes (every layer at the full length: sliding-window layers, which may keep fewer, are counted in full).
"""

from __future__ import annotations

from .model import GENERATE_PHASES, Plan

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}


def token_bytes(plan: Plan) -> int | None:
    """Bytes of one cached token, from the model facts the plan records; None where one of them is unknown."""
    attention = plan.config.get("attention") or {}
    dtype = plan.config.get("dtype")
    if dtype in (None, "auto"):  # loaded in the checkpoint's own dtype
        dtype = attention.get("dtype")
    sizes = (attention.get("layers"), attention.get("kv_heads"), attention.get("head_dim"),
             DTYPE_BYTES.get(str(dtype).removeprefix("torch.")))
    if not all(isinstance(n, int) and n > 0 for n in sizes):
        return None
    layers, heads, head_dim, width = sizes
    return 2 * layers * heads * head_dim * width  # type: ignore[operator]  # all ints, checked above


def peak_bytes(plan: Plan) -> int | None:
    """The static cache's largest allocation over the plan's `generate` calls; None without a static cache or where
    the model facts are unknown."""
    sizes = [s.batch * s.cache_len for s in plan.shapes if s.phase in GENERATE_PHASES and s.cache_len is not None]
    per_token = token_bytes(plan)
    if not sizes or per_token is None:
        return None
    return max(sizes) * per_token
