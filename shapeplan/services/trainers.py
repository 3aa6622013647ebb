"""The registry of TRL trainers shapeplan plans and warms: one `TrainerSpec` per method.

Every place that needs to know the methods (the CLI's choices, `analyze`, the default datasets, the warm runner,
the tests) reads `TRAINERS`. The plan functions and warmers are imported only when a spec's `plan()` or `warmer()`
is called, so reading the registry imports neither torch nor TRL (the CLI's `--help` stays fast).
Adding a trainer: see docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..errors import UsageError
from ..plan.model import LengthKind, Method, Phase, Plan

if TYPE_CHECKING:
    from ..adapters.trl_args import TrainingArgs
    from ..warm.runner import Warmer

# `plan(args, argv, *, eval_source, use_cache) -> Plan`, the shape of every adapter's entry point. Only SFT keeps a
# row-length cache so far (its datasets are the large ones); the others take `use_cache` so that every adapter has
# the same signature.
PlanFunction = Callable[..., Plan]


@dataclass(frozen=True, slots=True)
class PhaseRules:
    """How one trainer's model calls map to the plan's phases (shapeplan/guard/recorder.py applies them)."""

    generates: bool = False  # the policy's `generate` calls are generate / eval_generate
    logits_helper: str | None = None  # trainer method whose 4th argument, logits_to_keep, tags the forwards inside
    no_grad_phase: Phase | None = None  # the policy's no-grad forward in train mode (None: it is `train`)
    kl_helper: str | None = None  # trainer method inside which forwards are KL rows
    ref_eval_twins: bool = False  # the ref model's forwards in the eval loop are eval_ref (GRPO/RLOO keep `ref`)
    precompute: bool = False  # forwards before training are the reference precompute pass
    backbone: bool = False  # the backbones (`base_model`) of student and teacher carry the phases
    varlen: bool = False  # padding-free kwargs (cu_seq_lens_q, max_length_q) are recorded
    unpadded: bool = False  # whether each batch holds padding is recorded
    # the completion-token counts the loss selects by mask (`_compute_loss`'s inputs["completion_mask"]) are
    # recorded: "halves" (DPO: the chosen and the rejected half of the batch) or "labels" (KTO: the desirable and
    # the undesirable rows, and how many rows are desirable)
    loss_masks: Literal["halves", "labels"] | None = None


@dataclass(frozen=True, slots=True)
class TrainerSpec:
    """What shapeplan knows about one TRL method.

    `script`: the `trl.scripts` module whose parser reads the run's options (`trl <name>`); `trainer_class` and
    `config_class`: TRL's names (attributes of `trl`). `default_dataset` and `guide_options`: what TRL's Trainium
    guide runs, planned when the user gives no dataset / no training option; `guide_reward_funcs`: the guide
    example's reward functions (Python functions of its script, not TRL registry names: the warm-up keeps only
    their number, which sizes the rewards tensor). `phases`: every phase its plans can
    hold. `generates`: it generates completions during training (its plans hold generate sizes, advise varies the
    completion length). `lengths`: what its token lengths count, for `advise` and `analyze --histogram` (None:
    neither covers it). `old_logprobs_always`: it computes old log-probs every round, aligned steps or not.
    `phase_rules`: how the guard (and the oracle tests) tell its model calls' phases apart. `collated`: what its
    collator makes of a batch of examples, which accelerate's dispatch_batches slices by rows: "rows" (one row per
    example in every tensor), "halves" (every example's chosen sequence, then every rejected one) or "examples" (the
    list of example dicts itself, strings included, which accelerate can neither concatenate nor broadcast).
    """

    name: Method
    script: str
    trainer_class: str
    config_class: str
    default_dataset: str
    plan_function: Callable[[], PlanFunction]
    warmer_class: Callable[[], Callable[[Any], Warmer[Any]]]
    phases: tuple[Phase, ...]
    guide_options: tuple[str, ...] = ()
    guide_reward_funcs: tuple[str, ...] = ()
    generates: bool = False
    lengths: LengthKind | None = None
    old_logprobs_always: bool = False
    phase_rules: PhaseRules = PhaseRules()
    collated: Literal["rows", "halves", "examples"] = "rows"

    def plan(self, args: TrainingArgs, argv: list[str], *, eval_source: str | None = None,
             use_cache: bool = True) -> Plan:
        return self.plan_function()(args, argv, eval_source=eval_source, use_cache=use_cache)

    def warmer(self, args: Any) -> Warmer[Any]:
        """The method's warmer for the run `args` (its TrainingArgs)."""
        return self.warmer_class()(args)

    def trainer(self) -> Any:
        """TRL's trainer class."""
        import trl

        return getattr(trl, self.trainer_class)

    def config(self) -> Any:
        """TRL's config class."""
        import trl

        return getattr(trl, self.config_class)


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
    from ..warm.preference import DPOWarmer

    return DPOWarmer


def _kto_warmer() -> Callable[[Any], Warmer[Any]]:
    from ..warm.preference import KTOWarmer

    return KTOWarmer


def _reward_warmer() -> Callable[[Any], Warmer[Any]]:
    from ..warm.preference import RewardWarmer

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
                phase_rules=PhaseRules(varlen=True, unpadded=True)),
    TrainerSpec(name="grpo", script="trl.scripts.grpo", trainer_class="GRPOTrainer", config_class="GRPOConfig",
                default_dataset="trl-lib/tldr", plan_function=_generation_plan, warmer_class=_generation_warmer,
                phases=_GENERATION_PHASES, generates=True, lengths="prompts",
                guide_options=("--per_device_train_batch_size", "4", "--num_generations", "4",
                               "--max_completion_length", "128", "--cache_implementation", "static", "--bf16",
                               "true"),
                # TRL's trl-lib/tldr example rewards completions close to 20 characters
                guide_reward_funcs=("reward_len",), phase_rules=_GENERATION_RULES, collated="examples"),
    TrainerSpec(name="rloo", script="trl.scripts.rloo", trainer_class="RLOOTrainer", config_class="RLOOConfig",
                default_dataset="trl-lib/tldr", plan_function=_generation_plan, warmer_class=_generation_warmer,
                phases=_GENERATION_PHASES, generates=True, lengths="prompts",
                old_logprobs_always=True, phase_rules=_GENERATION_RULES, collated="examples"),
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
                collated="examples"),
)

TRAINERS: dict[str, TrainerSpec] = {spec.name: spec for spec in _SPECS}
METHODS: tuple[str, ...] = tuple(TRAINERS)
DEFAULT_METHOD = _SPECS[0].name  # what `--method` defaults to: SFT, the trainer most runs use


def trainer_spec(method: str) -> TrainerSpec:
    """The spec of `method`; UsageError naming the known methods for any other name."""
    spec = TRAINERS.get(method)
    if spec is None:
        raise UsageError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return spec
