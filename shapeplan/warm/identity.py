"""What every warmer checks and loads the same way: the run's tokenizer, and that a plan was made for this run."""

from __future__ import annotations

from typing import Any

from ..errors import PlanFileError
from ..plan.model import Plan


def load_run_tokenizer(args: Any) -> Any:
    """The tokenizer of the run's model, loaded as the planning adapters load it."""
    from ..adapters.data import load_tokenizer

    return load_tokenizer(args.model.model_name_or_path, revision=args.model.model_revision,
                          trust_remote_code=bool(args.training.trust_remote_code))


def check_plan_identity(plan: Plan, method: str, tokenizer: Any, model: str) -> None:
    """The plan must have been made for this method and this tokenizer."""
    from ..adapters.data import tokenizer_fingerprint

    if plan.method != method:
        raise PlanFileError(f"the plan is for `{plan.method}`, not {method}; pass --method {plan.method}")
    planned = plan.fingerprint.get("tokenizer")
    if planned is not None and planned != tokenizer_fingerprint(tokenizer):
        raise PlanFileError(f"the plan was made with another tokenizer than {model}'s; re-create it with "
                            f"`shapeplan analyze ... --model {model} -o PLAN`")


def check_plan_fits_model(plan: Plan, args: Any) -> None:
    """Every planned sequence must fit the model's position embeddings (when its config states them)."""
    from transformers import AutoConfig

    model = args.model.model_name_or_path
    try:
        config = AutoConfig.from_pretrained(model, revision=args.model.model_revision,
                                            trust_remote_code=bool(args.training.trust_remote_code))
    except (OSError, ValueError):  # no readable config here: loading the model reports it, with its own fix
        return
    limit = getattr(config, "max_position_embeddings", None)
    longest = max(plan.shapes, key=lambda s: s.seq)
    if isinstance(limit, int) and longest.seq > limit:
        raise PlanFileError(f"the plan has a {longest.phase} shape of seq {longest.seq}, beyond {model}'s "
                            f"max_position_embeddings {limit}; re-create the plan with a --max_length that fits")
