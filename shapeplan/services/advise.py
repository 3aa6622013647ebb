"""`advise`: the run as given and every what-if, each an exact plan from `analyze`, costed and ranked.

The alternatives re-plan with changed TRL options. They share one tokenization (`adapters.lengths.
shared_tokenization`): the untruncated lengths are read first, and every plan whose options change only batching,
padding, packing or max_length re-derives its rows from those token counts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CacheError, ShapeplanError, UsageError
from ..plan.advice import (
    Candidate,
    CostModel,
    Measurement,
    Option,
    Settings,
    calibrated,
    candidates,
    data_loss,
    plan_cost,
    ranked,
    recommendation,
)
from ..plan.caveats import caveats
from ..plan.grpo import cache_pin, pin_kwargs, pinned_cache
from ..plan.model import LengthKind, Plan
from .analyze import analyze
from .trainers import MEASURED, trainer_spec
from .trl_command import TrlCommand, trl_command, trl_options, with_options
from .vision_advice import ImageRun, VisionAdvice, advise_vision

if TYPE_CHECKING:
    from ..adapters.trl_args import TrainingArgs


@dataclasses.dataclass(frozen=True)
class Advice:
    method: str
    argv: tuple[str, ...]  # the baseline's TRL options
    eval_source: str | None  # the eval dataset given apart from TRL's options (`--eval-dataset`)
    lengths: tuple[int, ...]  # untruncated train rows (SFT) or prompts, in tokens
    baseline: Option
    options: tuple[Option, ...]  # the alternatives, fastest first
    skipped: tuple[tuple[str, str], ...]  # (alternative, why TRL or the planner refused it)
    model: CostModel
    recommended: Option | None
    recommendation: str
    warnings: tuple[str, ...]
    command: TrlCommand  # the baseline's `trl <method>` command, as it runs (a script's: under the guard)
    script: tuple[str, ...] | None = None  # the training script's command, where the run is a script's

    def recommended_command(self) -> TrlCommand | None:
        """The `trl <method>` command that runs the recommendation (its TRL flags last) and its notes, None when
        there is none; for a script, its command and the config values to set in it."""
        if self.recommended is None or self.recommended.candidate is None:
            return None
        candidate = self.recommended.candidate
        if self.script is not None:
            values = ", ".join(f"{name}={value}" for name, value in candidate.flags)
            return TrlCommand(words=self.command.words, notes=(f"set in the script's config: {values}",))
        pin = pinned_cache(self.recommended.plan)
        notes = trl_command(self.method, with_flags(self.argv, candidate), eval_source=self.eval_source,
                            pin_cache=pin).notes
        flags = trl_options(candidate.flags)
        if pin is not None:  # the what-if's own pin: another length than the baseline's where its calls differ
            kwargs = self.recommended.plan.config.get("generation_kwargs") or {}
            flags = [*flags, ("generation_kwargs", pin_kwargs(kwargs, pin))]
        return TrlCommand(words=(*self.command.words[:2], *with_options(self.command.words[2:], flags)),
                          notes=notes)


def advise(method: str, argv: Sequence[str], *, eval_source: str | None = None, use_cache: bool = True,
           calibrate: Path | None = None, allow_truncation: bool = False) -> Advice | VisionAdvice:
    """The advice for the run: padding, length and batch what-ifs (`Advice`), or for a vision-language SFT run,
    fixed image sizes (`VisionAdvice`)."""
    kind = trainer_spec(method).lengths
    if kind is None:
        raise UsageError(f"advise covers {', '.join(MEASURED)}, not {method}; use `shapeplan analyze --method "
                         f"{method}` to plan it")
    from ..adapters.lengths import shared_tokenization

    _check_cache_pin(method, argv)
    images = _vision_run(method, argv, eval_source)
    if images is not None:
        if calibrate is not None:
            raise UsageError("--calibrate costs text shapes; vision advice counts vision graphs, drop --calibrate")
        return advise_vision(method, images)

    with shared_tokenization():
        return _advise(method, kind, list(argv), eval_source=eval_source, use_cache=use_cache, calibrate=calibrate,
                       allow_truncation=allow_truncation)


def _check_cache_pin(method: str, argv: Sequence[str]) -> None:
    """A cache pin that is no cache length, refused before the what-ifs compare lengths with it."""
    from ..adapters.generation import check_cache_pin
    from ..adapters.trl_args import parse_training_args

    spec = trainer_spec(method)
    if spec.generates:
        check_cache_pin(parse_training_args(spec, list(argv)).training)


def _vision_run(method: str, argv: Sequence[str], eval_source: str | None) -> ImageRun | None:
    """The run read once where its train set has images (SFT, GRPO, RLOO); None for a text run."""
    from ..adapters.trl_args import parse_training_args

    spec = trainer_spec(method)
    return _images_of(parse_training_args(spec, list(argv)), list(argv), eval_source) if spec.images else None


def _images_of(args: TrainingArgs, argv: Sequence[str] = (), eval_source: str | None = None) -> ImageRun | None:
    """`_vision_run` of a run already read (a script's too)."""
    if not args.spec.images:
        return None
    if args.spec.lengths == "rows":
        from ..adapters.sft import vision_run

        return vision_run(args, list(argv), eval_source=eval_source)
    from ..adapters import grpo

    run = grpo.read(args, list(argv), eval_source=eval_source)
    return run if run.prompts is not None else None


def _advise(method: str, kind: LengthKind, argv: list[str], *, eval_source: str | None, use_cache: bool,
            calibrate: Path | None, allow_truncation: bool) -> Advice:
    from ..adapters.row_lengths import train_lengths

    argv = _effective_argv(method, argv)
    lengths = train_lengths(trainer_spec(method), argv, eval_source=eval_source, use_cache=use_cache)

    def plan_of(candidate: Candidate | None) -> Plan:
        words = argv if candidate is None else with_flags(argv, candidate)
        return analyze(method, words, eval_source=eval_source, use_cache=use_cache)

    return _weighed(method, kind, lengths, plan_of, calibrate=calibrate, allow_truncation=allow_truncation,
                    argv=tuple(argv), eval_source=eval_source,
                    command=lambda base: trl_command(method, argv, eval_source=eval_source,
                                                     pin_cache=pinned_cache(base)))


def advise_script(command: Sequence[str], *, calibrate: Path | None = None,
                  allow_truncation: bool = False) -> Advice | VisionAdvice:
    """`advise` for the run a training script builds (`advise -- python train.py`): each what-if is the script's
    config with the options changed, planned on the script's own objects (see `adapters/script/run.with_options`)."""
    from ..adapters.generation import check_cache_pin
    from ..adapters.lengths import shared_tokenization
    from ..adapters.row_lengths import UNTRUNCATED, lengths_of
    from ..adapters.script.command import parse_command
    from ..adapters.script.run import with_options
    from .analyze import plan_parsed
    from .script import script_args

    args = script_args(parse_command(list(command)))
    method, kind = args.method, args.spec.lengths
    if kind is None:
        raise UsageError(f"advise covers {', '.join(MEASURED)}, not {method}; plan the script with `shapeplan analyze "
                         "-- ...`")
    if args.spec.generates:
        check_cache_pin(args.training)
    images = _images_of(args)
    if images is not None:
        if calibrate is not None:
            raise UsageError("--calibrate costs text shapes; vision advice counts vision graphs, drop --calibrate")
        return advise_vision(method, images)

    def plan_of(candidate: Candidate | None) -> Plan:
        return plan_parsed(args if candidate is None else with_options(args, candidate.flags))

    with shared_tokenization():
        # never through the length cache, as a script's plans are not: its data's fingerprints come from code
        lengths = lengths_of(with_options(args, UNTRUNCATED) if kind == "rows" else args, use_cache=False)
        return _weighed(method, kind, lengths, plan_of, calibrate=calibrate, allow_truncation=allow_truncation,
                        argv=(), eval_source=None, command=lambda base: TrlCommand(words=tuple(command), notes=()),
                        script=tuple(command))


def _weighed(method: str, kind: LengthKind, lengths: tuple[int, ...], plan_of: Callable[[Candidate | None], Plan],
             *, calibrate: Path | None, allow_truncation: bool, argv: tuple[str, ...], eval_source: str | None,
             command: Callable[[Plan], TrlCommand], script: tuple[str, ...] | None = None) -> Advice:
    """The run's plan (`plan_of(None)`) and each what-if's, costed and ranked; `command`: the baseline's command, made
    from its plan (which may pin the cache the command must carry)."""
    base_plan = plan_of(None)
    model = calibrated_model(calibrate, torch_compile=bool(base_plan.config.get("torch_compile"))) \
        if calibrate is not None else CostModel()
    baseline = Option(candidate=None, plan=base_plan, cost=plan_cost(base_plan, model))
    options, skipped = [], []
    for candidate in candidates(settings_of(base_plan, lengths, kind)):
        try:
            plan = plan_of(candidate)
        except ShapeplanError as exc:
            skipped.append((candidate.label, str(exc)))
            continue
        loss = data_loss(base_plan, plan, candidate, lengths=lengths, kind=kind,
                         baseline_max_length=base_plan.config.get("max_length"))
        options.append(Option(candidate=candidate, plan=plan, cost=plan_cost(plan, model), loss=loss))
    recommended, line = recommendation(baseline, options, allow_truncation=allow_truncation)
    return Advice(method=method, argv=argv, eval_source=eval_source, lengths=lengths, baseline=baseline,
                  options=tuple(ranked(options)), skipped=tuple(skipped), model=model, recommended=recommended,
                  recommendation=line, warnings=(*base_plan.warnings, *caveats(base_plan, os.environ)),
                  command=command(base_plan), script=script)


def _effective_argv(method: str, argv: list[str]) -> list[str]:
    """`argv`, with the guide's example options spelled out when the planner would plan the example: an
    alternative adds options, which would otherwise switch the example off."""
    from ..adapters.grpo import with_guide_example
    from ..adapters.trl_args import parse_training_args

    spec = trainer_spec(method)
    example = spec.guide_options
    if not example:
        return argv
    _, notes = with_guide_example(parse_training_args(spec, argv), argv)
    return [*example, *argv] if notes else argv


def settings_of(plan: Plan, lengths: Sequence[int], kind: LengthKind) -> Settings:
    """The options advise varies, as `plan` has them; `lengths` are the untruncated train `kind`."""
    config = plan.config
    pin = cache_pin(plan.shapes)
    return Settings(
        method=plan.method,
        lengths=kind,
        pad_to_multiple_of=plan.pad_to_multiple_of,
        per_device_train_batch_size=int(config["per_device_train_batch_size"]),
        gradient_accumulation_steps=int(config["gradient_accumulation_steps"]),
        max_length=config.get("max_length"),
        packing=bool(config.get("packing")),
        packing_strategy=str(config.get("packing_strategy") or "bfd"),
        padding_free=bool(config.get("padding_free")),
        longest_row=max(lengths, default=0),
        max_completion_length=config.get("max_new_tokens") if trainer_spec(plan.method).generates else None,
        generation_kwargs=config.get("generation_kwargs") or {},
        pin_cache_len=pin.max_cache_len if pin is not None else None,
        pads_tool_turns=bool(config.get("pad_tool_turns")) if config.get("tool_turns") else None,
    )


def with_flags(argv: Sequence[str], candidate: Candidate) -> list[str]:
    """`argv` with the candidate's options replacing any given value."""
    return with_options(argv, candidate.flags)


def calibrated_model(cache_dir: Path, *, torch_compile: bool) -> CostModel:
    """The cost model fitted to what `shapeplan warm` measured in `cache_dir` (its manifest files, merged)."""
    from ..warm.manifest import MANIFEST, read_merged

    merged = read_merged(cache_dir)
    if not merged.files:
        raise CacheError(f"{cache_dir} has no {MANIFEST}; pass a cache dir `shapeplan warm` wrote")
    measurements = []
    for section in merged.environments.values():
        for key, entry in section["shapes"].items():
            compiled = entry.get("status") == "compiled"
            if not compiled and entry.get("steady_seconds") is None:
                continue
            phase, dims = key.split()[:2]
            batch, seq = (int(x) for x in dims.split("x"))
            measurements.append(Measurement(phase=phase, batch=batch, seq=seq,
                                            compile_s=float(entry["seconds"]) if compiled else None,
                                            steady_s=entry.get("steady_seconds")))
    if not measurements:
        raise CacheError(f"the manifest in {cache_dir} records no measured shape to calibrate with; warm a plan "
                         "into an empty cache dir first")
    return calibrated(measurements, torch_compile=torch_compile, source=f"calibrated from {cache_dir}")
