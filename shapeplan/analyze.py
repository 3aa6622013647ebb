"""`analyze`: from `trl <method>` arguments to a `Plan`. Each method's adapter does the method-specific part."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from .errors import UsageError
from .plan.model import METHODS, Plan

# method -> module in shapeplan.adapters with `plan(args, argv, *, eval_source, use_cache) -> Plan`.
# Only SFT keeps a row-length cache so far (its datasets are the large ones); the others take `use_cache` so that
# every adapter has the same signature.
PLANNED = {"sft": "sft", "grpo": "grpo", "rloo": "grpo", "dpo": "dpo", "kto": "kto", "reward": "reward",
           "distillation": "distillation"}


def analyze(method: str, argv: Sequence[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    """Plan the run `trl <method> ARGV` would make. ARGV holds TRL's options (and `--config FILE`).

    `use_cache=False` recomputes prepared row lengths instead of reading them from the length cache.
    """
    if method not in METHODS:
        raise UsageError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method not in PLANNED:
        raise UsageError(f"method {method!r} is not planned yet; supported: {', '.join(PLANNED)}")
    from .adapters.trl_args import parse_training_args

    args = parse_training_args(method, argv)
    adapter = importlib.import_module(f".adapters.{PLANNED[method]}", __package__)
    return adapter.plan(args, list(argv), eval_source=eval_source, use_cache=use_cache)
