"""`analyze`: from `trl <method>` arguments to a `Plan`. Each method's adapter does the method-specific part."""

from __future__ import annotations

from collections.abc import Sequence

from .plan.model import Plan
from .trainers import trainer_spec


def analyze(method: str, argv: Sequence[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    """Plan the run `trl <method> ARGV` would make. ARGV holds TRL's options (and `--config FILE`).

    `use_cache=False` recomputes prepared row lengths instead of reading them from the length cache.
    """
    spec = trainer_spec(method)
    from .adapters.trl_args import parse_training_args

    args = parse_training_args(method, argv)
    return spec.plan(args, list(argv), eval_source=eval_source, use_cache=use_cache)
