"""The Trainium guide's known breakages, as warnings with their exact fix: from the plan's config and the
environment the run will have. Pure: `environ` is passed in."""

from __future__ import annotations

from collections.abc import Mapping

from .model import Plan

_TRAIN_SIDE = ("train", "eval")
_NKI_SEQ, _NKI_HEAD_DIM = 512, 128


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
    out += _nki_attention(plan)
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


def _nki_attention(plan: Plan) -> list[str]:
    """Shapes TorchNeuron runs through its NKI flash-attention kernel: SDPA with no mask (a batch without padding),
    no dropout, sequence lengths multiples of 512, head_dim <= 128 (scaled_dot_product_fused_attention.py). That
    kernel keys its compile cache with Python's hash() of the dtypes, which differs in every process
    (nki_op_impl.py), so no cache serves them across processes. Eager calls only: under torch_compile the attention
    is decomposed into the graph (neuron_dynamo_backend/decompositions.py:332-440), whose key hashes the graph's
    StableHLO (compile.py:96-115), not the dtypes, so no warning there."""
    if plan.config.get("torch_compile"):
        return []
    attention = plan.config.get("attention") or {}
    head_dim = attention.get("head_dim")
    if attention.get("implementation") not in (None, "sdpa") or attention.get("dropout") or \
            (isinstance(head_dim, int) and head_dim > _NKI_HEAD_DIM):
        return []
    hit = [s for s in plan.shapes if s.unpadded and s.seq % _NKI_SEQ == 0 and not s.phase.endswith("generate")]
    if not hit:
        return []
    seqs = ", ".join(str(seq) for seq in sorted({s.seq for s in hit}))
    assumed = "" if isinstance(head_dim, int) else " (head_dim assumed <= 128: the model config is not readable)"
    return [f"{sum(s.unpadded for s in hit)} planned batches at seq {seqs} hold no padding{assumed}: TorchNeuron runs "
            "their attention through its NKI flash-attention kernel, whose compile-cache key differs in every process "
            "(torch-neuronx source, April 2026), so they compile again in every run, warmed or not, and `verify` "
            "reports them; `shapeplan doctor --device neuron` tells whether your release does this; fix: "
            "--attn_implementation eager (attention without SDPA never reaches that kernel)"]


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
