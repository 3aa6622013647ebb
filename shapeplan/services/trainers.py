"""The registry of TRL trainers shapeplan plans and warms: one `TrainerSpec` per method.

Every place that needs to know the methods (the CLI's choices, `analyze`, `load_run`, the guard, the tests) reads
`TRAINERS`; the layers below the services are handed the spec they need (`TrainingArgs.spec`), the class of which
lives in `adapters/trainer.py`. The plan functions and warmers are imported only when a spec's `plan()` or `warmer()`
is called, so reading the registry imports neither torch nor TRL (the CLI's `--help` stays fast).
Adding a trainer: see docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..adapters.trainer import PhaseRules, PlanFunction, TrainerSpec
from ..errors import UsageError
from ..plan.model import Phase

if TYPE_CHECKING:
    from ..warm.runner import Warmer

# -- plan functions and warmer classes, imported when used ---------------------------------------------------------


def _sft_plan() -> PlanFunction:
    from ..adapters.sft import plan

    return plan


def _generation_plan() -> PlanFunction:
    from ..adapters.grpo import plan

    return plan


def _dpo_plan() -> PlanFunction:
    from ..adapters.dpo import plan

    return plan


def _kto_plan() -> PlanFunction:
    from ..adapters.kto import plan

    return plan


def _reward_plan() -> PlanFunction:
    from ..adapters.reward import plan

    return plan


def _distillation_plan() -> PlanFunction:
    from ..adapters.distillation import plan

    return plan


def _sft_warmer() -> Callable[[Any], Warmer[Any]]:
    from ..warm.sft import SFTWarmer

    return SFTWarmer


def _generation_warmer() -> Callable[[Any], Warmer[Any]]:
    from ..warm.generation import GenerationWarmer

    return GenerationWarmer


def _dpo_warmer() -> Callable[[Any], Warmer[Any]]:
    from ..warm.dpo import DPOWarmer

    return DPOWarmer


def _kto_warmer() -> Callable[[Any], Warmer[Any]]:
    from ..warm.kto import KTOWarmer

    return KTOWarmer


def _reward_warmer() -> Callable[[Any], Warmer[Any]]:
    from ..warm.reward import RewardWarmer

    return RewardWarmer


def _distillation_warmer() -> Callable[[Any], Warmer[Any]]:
    from ..warm.distillation import DistillationWarmer

    return DistillationWarmer


_GENERATION_PHASES: tuple[Phase, ...] = ("generate", "eval_generate", "train", "eval", "old_logprob", "ref")
_GENERATION_RULES = PhaseRules(generates=True, logits_helper="_get_per_token_logps_and_entropies",
                               no_grad_phase="old_logprob")

_SPECS = (
    TrainerSpec(name="sft", script="trl.scripts.sft", trainer_class="SFTTrainer", config_class="SFTConfig",
                default_dataset="trl-lib/Capybara", plan_function=_sft_plan, warmer_class=_sft_warmer,
                phases=("train", "eval"), lengths="rows",
                phase_rules=PhaseRules(varlen=True, unpadded=True), images=True, warm_images=True),
    TrainerSpec(name="grpo", script="trl.scripts.grpo", trainer_class="GRPOTrainer", config_class="GRPOConfig",
                default_dataset="trl-lib/tldr", plan_function=_generation_plan, warmer_class=_generation_warmer,
                phases=_GENERATION_PHASES, generates=True, lengths="prompts",
                guide_options=("--per_device_train_batch_size", "4", "--num_generations", "4",
                               "--max_completion_length", "128", "--cache_implementation", "static", "--bf16",
                               "true"),
                # TRL's trl-lib/tldr example rewards completions close to 20 characters
                guide_reward_funcs=("reward_len",), phase_rules=_GENERATION_RULES, collated="examples",
                agentic=("tools", "environment_factory", "rollout_func"), images=True),
    TrainerSpec(name="rloo", script="trl.scripts.rloo", trainer_class="RLOOTrainer", config_class="RLOOConfig",
                default_dataset="trl-lib/tldr", plan_function=_generation_plan, warmer_class=_generation_warmer,
                phases=_GENERATION_PHASES, generates=True, lengths="prompts",
                old_logprobs_always=True, phase_rules=_GENERATION_RULES, collated="examples", images=True),
    TrainerSpec(name="dpo", script="trl.scripts.dpo", trainer_class="DPOTrainer", config_class="DPOConfig",
                default_dataset="trl-lib/ultrafeedback_binarized", plan_function=_dpo_plan,
                warmer_class=_dpo_warmer, phases=("train", "eval", "ref", "eval_ref", "ref_precompute"),
                phase_rules=PhaseRules(no_grad_phase="kl", ref_eval_twins=True, precompute=True, unpadded=True,
                                       loss_masks="halves"),
                collated="halves"),
    TrainerSpec(name="kto", script="trl.scripts.kto", trainer_class="KTOTrainer", config_class="KTOConfig",
                default_dataset="trl-lib/kto-mix-14k", plan_function=_kto_plan, warmer_class=_kto_warmer,
                phases=("train", "eval", "ref", "eval_ref", "kl", "eval_kl", "ref_kl", "eval_ref_kl",
                        "ref_precompute"),
                phase_rules=PhaseRules(no_grad_phase="kl", kl_helper="_compute_kl_logps", ref_eval_twins=True,
                                       precompute=True, unpadded=True, loss_masks="labels")),
    TrainerSpec(name="reward", script="trl.scripts.reward", trainer_class="RewardTrainer",
                config_class="RewardConfig", default_dataset="trl-lib/ultrafeedback_binarized",
                plan_function=_reward_plan, warmer_class=_reward_warmer, phases=("train", "eval"),
                phase_rules=PhaseRules(unpadded=True), collated="halves"),
    TrainerSpec(name="distillation", script="trl.scripts.distillation", trainer_class="DistillationTrainer",
                config_class="DistillationConfig", default_dataset="trl-lib/ultrafeedback-prompt",
                plan_function=_distillation_plan, warmer_class=_distillation_warmer,
                phases=("generate", "eval_generate", "train", "eval", "teacher", "eval_teacher"),
                generates=True, lengths="prompts",
                phase_rules=PhaseRules(generates=True, logits_helper="_get_last_hidden_state", backbone=True),
                collated="examples", agentic=("tools",)),
)

TRAINERS: dict[str, TrainerSpec] = {spec.name: spec for spec in _SPECS}
METHODS: tuple[str, ...] = tuple(TRAINERS)
DEFAULT_METHOD = _SPECS[0].name  # what `--method` defaults to: SFT, the trainer most runs use
# the methods whose token lengths `advise` and `analyze --histogram` read (`TrainerSpec.lengths`)
MEASURED: tuple[str, ...] = tuple(name for name, spec in TRAINERS.items() if spec.lengths is not None)


def trainer_spec(method: str) -> TrainerSpec:
    """The spec of `method`; UsageError naming the known methods for any other name."""
    spec = TRAINERS.get(method)
    if spec is None:
        raise UsageError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return spec
