"""Phase-aware shape recording: every input a TRL trainer's models receive, under the plan's phase names, reported
*before* the forward runs. The one place that says which model call is which phase: the guard and the oracle tests
(tests/oracle/) both record through `ShapeRecorder`, so they cannot disagree.

Phases are told apart by what runs, the way the plan names them:
    generate / eval_generate   the policy's `generate` (train / eval mode): the prefill's (batch, seq) and the static
                               cache length (None with a dynamic cache); decode forwards are not recorded
    train                      the policy's forward in train mode (with grad where the method has no-grad phases)
    old_logprob / kl           the policy's no-grad forward in train mode (GRPO/RLOO; DPO/KTO/Reward)
    eval / eval_kl             the policy's forward in eval mode (eval_kl inside KTO's KL pass)
    ref / ref_kl               the reference model (its eval_* twins while the policy is in eval mode, DPO/KTO)
    ref_precompute             any forward before training starts (DPO/KTO's `precompute_ref_log_probs` pass; TRL
                               skips a dataset's pass when its datasets cache holds that pass's result, which
                               `precomputed_from_cache` names)
    teacher / eval_teacher     Distillation's teacher backbone during a train step / in the eval loop
Distillation's student and teacher run their backbones (`base_model`) directly: the backbones carry its phases.
Under PEFT (adapters/lora.py) the hooks sit on the transformers model inside the `PeftModel`, which every forward
and `generate` reaches, and a policy forward with its adapters disabled is the reference forward (ref, ref_kl and
their eval twins), as TRL runs it instead of a reference model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ..adapters.lora import adapters_off, inner_model
from ..errors import UsageError
from ..plan.model import Method, Phase
from ..plan.vision import FAMILIES
from ..services.trainers import TRAINERS

# The batch tensors in which a family's batches hold their images' keys (Qwen-VL's image_grid_thw).
KEYS_TENSORS = tuple(sorted({f.KEYS_TENSOR for f in FAMILIES.values() if f.KEYS_TENSOR is not None}))


@dataclass(frozen=True, slots=True)
class Forward:
    """One model input, as the plan counts it."""

    phase: Phase
    batch: int
    seq: int
    step: int  # train side: the optimizer step being computed (1-based); eval side: global_step when it ran
    cache_len: int | None = None  # generate phases: the static cache length
    logits_to_keep: int | None = None  # what the trainer passed to its log-prob helper for this forward
    cu_seq_lens: int | None = None  # padding-free: len(cu_seq_lens_q) the model received
    max_length_q: int | None = None  # padding-free: the max_length_q kwarg the model received
    unpadded: bool = False  # attention takes the batch as unpadded (SDPA then skips the mask)
    rank: int = 0
    completion_tokens: tuple[int, ...] = ()  # DPO/KTO policy forwards: the token counts the loss selects by mask
    chosen_rows: int | None = None  # KTO policy forwards: the desirable rows of the batch
    turn: int | None = None  # GRPO's tool loop: the turn (1, 2, ...) of a round whose `generate` this is
    pixel_values: tuple[int, ...] | None = None  # vision batches: the shape of the pixel tensor the model received
    images: tuple[tuple[int, ...], ...] = ()  # vision batches: each image's key, where the batch holds them

    @property
    def key(self) -> tuple[Any, ...]:
        """What the plan's `Shape.key` holds for this input (max_new_tokens is a generate's setting, not seen)."""
        return (self.phase, self.batch, self.seq, self.cache_len, self.logits_to_keep, self.images, self.pixel_values)


def _tool_turn() -> int | None:
    """Which turn of GRPOTrainer's tool loop (`_tool_call_loop`, counting `iteration_num` from 0) calls `generate`
    now, or None outside it."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_tool_call_loop":
            return int(frame.f_locals.get("iteration_num", 0)) + 1
        frame = frame.f_back
    return None


def trainer_method(trainer: Any) -> Method:
    """The plan method of a TRL trainer instance (from its class or the first TRL base class it has)."""
    methods = {spec.trainer_class: spec.name for spec in TRAINERS.values()}
    for cls in type(trainer).__mro__:
        if cls.__name__ in methods:
            return methods[cls.__name__]
    raise UsageError(f"{type(trainer).__name__} is not a TRL trainer shapeplan knows; the guard covers "
                     f"{', '.join(methods)}")


def unpadded(kwargs: dict[str, Any]) -> bool:
    """Whether transformers' mask building sees no padding in a forward's kwargs (`_preprocess_mask_arguments`):
    an attention mask of all ones, or without one, position ids that run as one sequence per row. Read from host
    copies: an op on the device tensors would be a kernel of the guard's own, a compile on Neuron that the run
    unguarded never meets."""
    from transformers.masking_utils import find_packed_sequence_indices

    mask = kwargs.get("attention_mask")
    if mask is not None:
        return bool(mask.cpu().all())
    position_ids = kwargs.get("position_ids")
    return position_ids is None or find_packed_sequence_indices(position_ids.cpu()) is None


def loss_mask_sizes(inputs: dict[str, Any], kind: str | None) -> dict[str, Any]:
    """What DPO's / KTO's loss and metrics select from a batch by mask (the plan's `completion_tokens` and
    `chosen_rows`): the completion tokens of the chosen and of the rejected half ("halves"), or of the desirable
    and of the undesirable rows and how many rows are desirable ("labels"). Read from a host copy of the mask, so
    recording adds no device op."""
    mask = inputs["completion_mask"].cpu()[..., 1:]  # the loss scores tokens 1..L (shifted labels)
    if kind == "halves":
        chosen, rejected = mask.chunk(2, dim=0)
        return {"completion_tokens": (int(chosen.sum()), int(rejected.sum()))}
    label = inputs["label"]
    labels = [bool(x) for x in (label.tolist() if hasattr(label, "tolist") else label)]  # one host copy
    chosen = mask[[i for i, label in enumerate(labels) if label]]
    rejected = mask[[i for i, label in enumerate(labels) if not label]]
    return {"completion_tokens": (int(chosen.sum()), int(rejected.sum())), "chosen_rows": sum(labels)}


def vision_inputs(kwargs: dict[str, Any], *, sort: bool = False) -> dict[str, Any]:
    """What a forward's images feed the model: the shape of `pixel_values`, and the images' keys where the batch
    holds them (Qwen-VL's `image_grid_thw` rows: a copy of a few integers to the host, which the model's own rope
    and window index make of the same tensor anyway); `sort`: the keys in sorted order."""
    pixels = kwargs.get("pixel_values")
    if pixels is None:
        return {}
    out: dict[str, Any] = {"pixel_values": tuple(int(d) for d in pixels.shape)}
    for name in KEYS_TENSORS:
        keys = kwargs.get(name)
        if keys is not None:
            rows = [tuple(int(v) for v in row) for row in keys.tolist()]
            out["images"] = tuple(sorted(rows) if sort else rows)
    return out


def _input_ids(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs.get("input_ids", args[0] if args else None)


class ShapeRecorder:
    """Hooks a trainer's policy (at `attach`, before any precompute pass) and its reference model and teacher
    (`attach_late`, once the trainer has built them), and calls `listener` with each input before its forward.

    `listener` may raise to stop the forward. `start_training` marks the end of the precompute pass.
    `precomputed_from_cache`: the datasets ("train", "eval") whose precompute pass TRL read from its datasets cache
    instead of running it (it keys the cached log-probs by the dataset's and the model's fingerprints).
    """

    def __init__(self, trainer: Any, listener: Callable[[Forward], None], *, method: str | None = None) -> None:
        self.trainer = trainer
        self.method = method or trainer_method(trainer)
        self.rules = TRAINERS[self.method].phase_rules
        self.listener = listener
        self.training = False
        self._hooked: set[int] = set()
        self._handles: list[Any] = []
        self._in_generate = False
        self._turn: int | None = None  # the tool turn of the `generate` in progress
        self._generate_vision: dict[str, Any] = {}  # the pixel batch the `generate` in progress encodes
        self._cache: Any = None
        self._logits_to_keep: int | None = None
        self._kl = False
        self._precompute_forwards = 0
        self._loss_sizes: dict[str, Any] = {}
        self.precomputed_from_cache: list[str] = []
        self._rank = int(trainer.args.process_index)
        self.policy: Any = None

    # -- installing -----------------------------------------------------------------------------------------------

    def attach(self) -> None:
        trainer, rules = self.trainer, self.rules
        self.policy = trainer.accelerator.unwrap_model(trainer.model)
        if rules.generates:
            self._wrap_generate(self.policy)
        if rules.logits_helper:
            self._wrap_helper(rules.logits_helper, self._keeping_logits)
        if rules.kl_helper:
            self._wrap_helper(rules.kl_helper, self._in_kl)
        if rules.precompute:
            self._wrap_helper("_precompute_ref_logps", self._precomputing)
        if rules.loss_masks:
            self._wrap_helper("_compute_loss", self._in_loss)
        model = inner_model(self.policy)
        if rules.backbone:
            self._hook(model, self._generate_only_hook)
            self._hook(model.base_model, self._phase_hook("train", "eval"))
        else:
            self._hook(model, self._policy_hook)
        self.attach_late()

    def attach_late(self) -> None:
        """Hook the reference model and the teacher, if the trainer has built them by now (idempotent)."""
        unwrap = self.trainer.accelerator.unwrap_model
        ref = getattr(self.trainer, "ref_model", None)
        if ref is not None:
            self._hook(unwrap(ref), self._ref_hook)
        teacher = getattr(self.trainer, "teacher_model", None)
        if teacher is not None and self.rules.backbone:
            self._hook(unwrap(teacher).base_model, self._phase_hook("teacher", "eval_teacher"))

    def start_training(self) -> None:
        self.training = True
        self.attach_late()

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, module: Any, hook: Callable[..., None]) -> None:
        if id(module) in self._hooked:
            return
        import torch

        self._hooked.add(id(module))
        # torch.compile traces a module's hooks with its forward: keep the recorder out of the compiled graphs, so a
        # guarded run compiles the same graphs as the warm-up
        self._handles.append(module.register_forward_pre_hook(torch.compiler.disable(hook), with_kwargs=True))

    def _wrap_generate(self, model: Any) -> None:
        generate = model.generate

        def recording_generate(*args: Any, **kwargs: Any) -> Any:
            self._in_generate, self._cache, self._turn = True, None, _tool_turn()
            # transformers encodes a generate's images before its first forward (which then gets the encoder's
            # outputs, not the pixels): the call's own arguments are what the vision tower receives
            self._generate_vision = vision_inputs(kwargs)
            try:
                return generate(*args, **kwargs)
            finally:
                self._in_generate = False

        model.generate = recording_generate

    def _wrap_helper(self, name: str, around: Callable[..., Any]) -> None:
        helper = getattr(self.trainer, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with around(args, kwargs):
                return helper(*args, **kwargs)

        setattr(self.trainer, name, wrapped)

    @contextmanager
    def _keeping_logits(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
        # (model, input_ids, attention_mask, logits_to_keep, ...) in both TRL helpers
        self._logits_to_keep = kwargs.get("logits_to_keep", args[3] if len(args) > 3 else None)
        try:
            yield
        finally:
            self._logits_to_keep = None

    @contextmanager
    def _in_kl(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
        self._kl = True
        try:
            yield
        finally:
            self._kl = False

    @contextmanager
    def _in_loss(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
        # (model, inputs, return_outputs) in DPO's and KTO's `_compute_loss`
        inputs = kwargs.get("inputs", args[1] if len(args) > 1 else None)
        self._loss_sizes = loss_mask_sizes(inputs, self.rules.loss_masks) if inputs is not None else {}
        try:
            yield
        finally:
            self._loss_sizes = {}

    @contextmanager
    def _precomputing(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
        # (dataset, name, batch_size) in DPO's and KTO's `_precompute_ref_logps`
        before, training = self._precompute_forwards, self.training
        yield
        # (a pass `evaluate(eval_dataset)` runs during training is recorded as the eval loop's: not counted here)
        if not training and self._precompute_forwards == before:  # no forward: TRL read the result from its cache
            self.precomputed_from_cache.append(str(kwargs.get("name", args[1] if len(args) > 1 else "train")))

    # -- recording ------------------------------------------------------------------------------------------------

    def _step(self) -> int:
        return self.trainer.state.global_step + (1 if self.policy.training else 0)

    def _emit(self, phase: Phase, ids: Any, kwargs: dict[str, Any], **extra: Any) -> None:
        if self.rules.precompute and not self.training:
            phase, step = "ref_precompute", 0
            self._precompute_forwards += 1
        else:
            step = self._step()
        if self.rules.varlen:
            cu, max_q = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
            extra["cu_seq_lens"] = None if cu is None else int(cu.numel())
            extra["max_length_q"] = None if max_q is None else int(max_q)
        if self.rules.unpadded:
            extra["unpadded"] = unpadded(kwargs)
        # a generating trainer shuffles each round's rows before training on them (`shuffle_sequence_dict`): the
        # plan keys a train forward's grids in sorted order, one entry for every order
        extra.update(vision_inputs(kwargs, sort=phase == "train" and self.rules.generates))
        self.listener(Forward(phase, int(ids.shape[0]), int(ids.shape[1]), step, rank=self._rank, **extra))

    def _generate_prefill(self, module: Any, ids: Any, kwargs: dict[str, Any]) -> None:
        from transformers import StaticCache

        cache = kwargs.get("cache")
        if self._cache is not None and cache is self._cache:
            return  # a decode step of the same call
        self._cache = cache
        cache_len = cache.get_max_length() if isinstance(cache, StaticCache) else None
        self.listener(Forward("generate" if module.training else "eval_generate", int(ids.shape[0]),
                              int(ids.shape[1]), self._step(), cache_len=cache_len, rank=self._rank,
                              turn=self._turn, **self._generate_vision))

    def _policy_hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch

        ids = _input_ids(args, kwargs)
        if self._in_generate:
            self._generate_prefill(module, ids, kwargs)
            return
        if adapters_off(self.policy):
            self._ref_hook(module, args, kwargs)
            return
        phase: Phase
        if not module.training:
            phase = "eval_kl" if self._kl else "eval"
        elif self.rules.no_grad_phase and not torch.is_grad_enabled():
            phase = self.rules.no_grad_phase
        else:
            phase = "train"
        sizes = self._loss_sizes if phase in ("train", "eval") else {}
        self._emit(phase, ids, kwargs, logits_to_keep=self._logits_to_keep, **sizes)

    def _generate_only_hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._in_generate:
            self._generate_prefill(module, _input_ids(args, kwargs), kwargs)

    def _phase_hook(self, phase: Phase, eval_phase: Phase) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._in_generate:
                return
            self._emit(phase if self.policy.training else eval_phase, _input_ids(args, kwargs), kwargs,
                       logits_to_keep=self._logits_to_keep)
        return hook

    def _ref_hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        phase: Phase = "ref_kl" if self._kl else "ref"
        if self.rules.ref_eval_twins and not self.policy.training:
            phase = "eval_ref_kl" if self._kl else "eval_ref"
        self._emit(phase, _input_ids(args, kwargs), kwargs, logits_to_keep=self._logits_to_keep)
