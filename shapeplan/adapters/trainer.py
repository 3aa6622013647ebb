"""What shapeplan knows about one TRL trainer: `TrainerSpec`, and `PhaseRules`, how the guard tells its model calls'
phases apart.

The specs themselves, one per method, are the registry `shapeplan/services/trainers.py`, which also wires each
method to its adapter and its warmer. Code below the services takes the spec it needs (`TrainingArgs.spec`) instead
of looking the registry up, so no layer imports one above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..plan.model import LengthKind, Method, Phase, Plan

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
    `agentic`: the trainer arguments of Python objects (`tools`, `environment_factory`, `rollout_func`) its plans
    take, named on the command line as `module:attr`. `phase_rules`: how the guard (and the oracle tests) tell its
    model calls' phases apart. `collated`: what its collator makes of a batch of examples, which accelerate's
    dispatch_batches slices by rows: "rows" (one row per example in every tensor), "halves" (every example's chosen
    sequence, then every rejected one) or "examples" (the list of example dicts itself, strings included, which
    accelerate can neither concatenate nor broadcast).
    """

    name: Method
    script: str
    trainer_class: str
    config_class: str
    default_dataset: str
    plan_function: Callable[[], PlanFunction]
    warmer_class: Callable[[], Callable[[Any], Any]]  # () -> the warmer class (a `warm.runner.Warmer`)
    phases: tuple[Phase, ...]
    guide_options: tuple[str, ...] = ()
    guide_reward_funcs: tuple[str, ...] = ()
    generates: bool = False
    lengths: LengthKind | None = None
    old_logprobs_always: bool = False
    phase_rules: PhaseRules = PhaseRules()
    collated: Literal["rows", "halves", "examples"] = "rows"
    agentic: tuple[str, ...] = ()  # the trainer's arguments of Python objects shapeplan plans (tools=, ...)
    images: bool = False  # its plans hold vision-language rows (image columns); other methods refuse them
    warm_images: bool = False  # its warmer feeds those rows' vision batches (warm refuses a vision plan otherwise)

    def plan(self, args: Any, argv: list[str], *, eval_source: str | None = None,
             use_cache: bool = True) -> Plan:
        """The method's plan of the run `args` (its TrainingArgs), parsed from TRL's `argv`."""
        return self.plan_function()(args, argv, eval_source=eval_source, use_cache=use_cache)

    def warmer(self, args: Any) -> Any:
        """The method's warmer (a `warm.runner.Warmer`) for the run `args`."""
        return self.warmer_class()(args)

    def trainer(self) -> Any:
        """TRL's trainer class."""
        import trl

        return getattr(trl, self.trainer_class)

    def config(self) -> Any:
        """TRL's config class."""
        import trl

        return getattr(trl, self.config_class)
