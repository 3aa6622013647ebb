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
