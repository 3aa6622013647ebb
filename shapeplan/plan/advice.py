"""What-if advice, pure: the cost model (compile + step seconds), the alternatives to plan, and their ranking.

The cost of a plan is compile time plus training time:

- compile seconds per distinct shape, by phase kind: `train_compile_s` for every forward/backward graph,
  `generate_compile_s` per static-cache generate size (defaults: the guide's ~1 min and ~12 min, `plan/cost.py`);
- step seconds of one micro-batch of shape (b, s) in the `train` phase:
  `step_fixed_s + step_token_s * b*s + step_attention_s * b*s^2`; a no-grad forward phase (eval, ref, old log-probs,
  teacher, KL) costs `forward_share` of that (the backward is about twice the forward); a generate call costs its
  prefill forward plus `max_new_tokens` decode steps of `decode_fixed_s + forward_share * (step_token_s * b +
  step_attention_s * b * cache_len)`; with `torch_compile` every step is `compiled_speedup` times the eager one.
  Generation trainers are costed as if every completion reached `max_completion_length` (an upper bound).

The defaults are anchored on TRL's Trainium guide, Qwen3-0.6B SFT on trn2, batch 4 at max_length 1024: 1.71 s per
eager step and 1.15 s with torch_compile (so `compiled_speedup` = 1.15 / 1.71). How the 1.71 s splits into a fixed
part (0.2 s: optimizer step, launch) and attention (0.15 s at 4 x 1024) is an assumption, as is `decode_fixed_s`;
`--calibrate CACHE_DIR` replaces all of them with what `shapeplan warm` measured (`calibrated`).
"""

from __future__ import annotations

import shlex
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .buckets import round_up
from .cost import GENERATE_SHAPE_MINUTES, TRAIN_SHAPE_MINUTES
from .grpo import pin_kwargs
from .model import GENERATE_PHASES, LengthKind, Phase, Plan, Shape

# Guide anchor: eager train step of batch 4 x 1024 tokens (Qwen3-0.6B, trn2), and the torch_compile step.
_ANCHOR_BATCH, _ANCHOR_SEQ, _ANCHOR_EAGER_S, _ANCHOR_COMPILED_S = 4, 1024, 1.71, 1.15
_FIXED_S, _ATTENTION_AT_ANCHOR_S = 0.2, 0.15

PAD_CHOICES: tuple[int | None, ...] = (64, 128, 256, 512, None)
_MAX_CAPS = 8  # max_length / max_completion_length caps tried below the current value, the largest first
_MAX_BATCH = 64


@dataclass(frozen=True, slots=True)
class CostModel:
    train_compile_s: float = TRAIN_SHAPE_MINUTES * 60
    generate_compile_s: float = GENERATE_SHAPE_MINUTES * 60
    step_fixed_s: float = _FIXED_S
    step_token_s: float = (_ANCHOR_EAGER_S - _FIXED_S - _ATTENTION_AT_ANCHOR_S) / (_ANCHOR_BATCH * _ANCHOR_SEQ)
    step_attention_s: float = _ATTENTION_AT_ANCHOR_S / (_ANCHOR_BATCH * _ANCHOR_SEQ ** 2)
    forward_share: float = 1 / 3
    decode_fixed_s: float = 0.03
    compiled_speedup: float = _ANCHOR_COMPILED_S / _ANCHOR_EAGER_S
    source: str = "defaults (TRL Trainium guide, Qwen3-0.6B on trn2)"

    def compile_seconds(self, shape: Shape) -> float:
        return self.generate_compile_s if shape.phase in GENERATE_PHASES else self.train_compile_s

    def step_seconds(self, shape: Shape, *, torch_compile: bool) -> float:
        """Seconds of one micro-batch (one call, for generate) of `shape`."""
        b, s = shape.batch, shape.seq
        sized = self.step_token_s * b * s + self.step_attention_s * b * s * s
        if shape.phase == "train":
            seconds = self.step_fixed_s + sized
        elif shape.phase in GENERATE_PHASES:
            cache = shape.cache_len or s + (shape.max_new_tokens or 0)
            decode = self.decode_fixed_s + self.forward_share * (self.step_token_s * b
                                                                 + self.step_attention_s * b * cache)
            seconds = self.step_fixed_s + self.forward_share * sized + (shape.max_new_tokens or 0) * decode
        else:
            seconds = self.step_fixed_s + self.forward_share * sized
        return seconds * (self.compiled_speedup if torch_compile else 1.0)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["formula"] = ("train step = step_fixed_s + step_token_s*b*s + step_attention_s*b*s^2; forward phases: "
                          "step_fixed_s + forward_share*(sized part); generate: prefill forward + max_new_tokens * "
                          "(decode_fixed_s + forward_share*(step_token_s*b + step_attention_s*b*cache_len)); "
                          "x compiled_speedup under torch_compile; compile = train_compile_s per graph, "
                          "generate_compile_s per generate size")
        return out


@dataclass(frozen=True, slots=True)
class PlanCost:
    shapes_per_phase: dict[str, int]
    compile_s: float
    train_s: float

    @property
    def total_s(self) -> float:
        return self.compile_s + self.train_s


def plan_cost(plan: Plan, model: CostModel) -> PlanCost:
    """Compile seconds (each distinct graph once) and training seconds (sum of count x step seconds)."""
    torch_compile = bool(plan.config.get("torch_compile"))
    distinct = {s.key: s for s in plan.shapes}
    per_phase: dict[str, int] = defaultdict(int)
    for key in distinct:
        per_phase[key[0]] += 1
    compile_s = sum(model.compile_seconds(s) for s in distinct.values())
    train_s = sum(count * model.step_seconds(shape, torch_compile=torch_compile)
                  for shape, count in _costed(plan.shapes))
    return PlanCost(shapes_per_phase=dict(per_phase), compile_s=compile_s, train_s=train_s)


def _costed(shapes: Sequence[Shape]) -> Iterable[tuple[Shape, int]]:
    """Each shape with the count it is costed at. Completion buckets only sampling decides (`certain` False) are
    alternatives to each other: each (phase, batch, prompt part) group is costed once, at its longest bucket with
    the group's largest count, as if every completion reached max_completion_length."""
    groups: dict[tuple[Any, ...], list[Shape]] = defaultdict(list)
    for shape in shapes:
        if shape.logits_to_keep is None:
            yield shape, shape.count
        else:
            groups[(shape.phase, shape.batch, shape.seq - shape.logits_to_keep)].append(shape)
    for group in groups.values():
        if all(s.certain for s in group):
            yield from ((s, s.count) for s in group)
        else:
            yield max(group, key=lambda s: s.seq), max(s.count for s in group)


# --- calibration from `shapeplan warm`'s manifest -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Measurement:
    """One warmed shape: seconds of its first run when it compiled (None: it compiled nothing, e.g. eager on CPU)
    and of a second, steady-state run (None: unmeasured)."""

    phase: Phase
    batch: int
    seq: int
    compile_s: float | None
    steady_s: float | None


def calibrated(measurements: Sequence[Measurement], *, torch_compile: bool, source: str,
               base: CostModel = CostModel()) -> CostModel:
    """`base` fitted to measurements: compile seconds per phase kind are the mean measured compile time (first run
    minus steady run); step terms are scaled so the model's seconds for the measured shapes sum to the measured
    steady seconds. Kinds without a measurement keep `base`'s values."""
    if not measurements:
        return base
    fields: dict[str, float] = {}
    for name, generating in (("train_compile_s", False), ("generate_compile_s", True)):
        compiled = [m.compile_s - (m.steady_s or 0.0) for m in measurements
                    if (m.phase in GENERATE_PHASES) == generating and m.compile_s is not None]
        if compiled:
            fields[name] = sum(max(0.0, c) for c in compiled) / len(compiled)
    steady = [m for m in measurements if m.steady_s is not None and m.phase not in GENERATE_PHASES]
    if steady:
        predicted = sum(base.step_seconds(Shape(phase=m.phase, batch=m.batch, seq=m.seq, count=1, first_step=0),
                                          torch_compile=torch_compile) for m in steady)
        scale = sum(m.steady_s or 0.0 for m in steady) / predicted
        fields.update(step_fixed_s=base.step_fixed_s * scale, step_token_s=base.step_token_s * scale,
                      step_attention_s=base.step_attention_s * scale, decode_fixed_s=base.decode_fixed_s * scale)
    return replace(base, source=f"{source} ({len(measurements)} shapes, {len(steady)} with steady-state seconds)",
                   **fields)


# --- the alternatives ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Settings:
    """The baseline's values of the options advise varies."""

    method: str
    lengths: LengthKind  # what `longest_row` counts, and so which options apply
    pad_to_multiple_of: int | None
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    max_length: int | None = None  # SFT
    packing: bool = False
    packing_strategy: str = "bfd"
    padding_free: bool = False
    longest_row: int = 0  # the longest untruncated train row (SFT) or prompt
    max_completion_length: int | None = None  # generation trainers
    generation_kwargs: Mapping[str, Any] = field(default_factory=dict)
    pin_cache_len: int | None = None  # the max_cache_len that pins one static cache length, when several are met
    pads_tool_turns: bool | None = None  # whether tool turns are padded to the round's rows; None: no tool loop


@dataclass(frozen=True, slots=True)
class Candidate:
    """One what-if: the TRL options that change (name -> value as TRL parses it) and what it is."""

    label: str
    flags: tuple[tuple[str, str], ...]
    caps_completions: bool = False  # cuts generated completions: loses data

    def argv(self) -> list[str]:
        return [token for name, value in self.flags for token in (f"--{name}", value)]

    def command_line(self) -> str:
        return " ".join(shlex.quote(token) for token in self.argv())


def candidates(settings: Settings) -> list[Candidate]:
    """Every alternative to plan against the baseline `settings`, each one change."""
    out: list[Candidate] = []
    multiple = settings.pad_to_multiple_of or 128
    for pad in PAD_CHOICES:
        if pad != settings.pad_to_multiple_of:
            out.append(Candidate(f"pad_to_multiple_of {pad or 'none'}",
                                 (("pad_to_multiple_of", str(pad) if pad else "none"),)))
    if settings.lengths == "rows":
        out += _sft_candidates(settings, multiple)
    if settings.lengths == "prompts":
        out += _generation_candidates(settings, multiple)
    out += _batch_candidates(settings)
    return out


def _caps_below(current: int | None, longest: int, multiple: int) -> list[int]:
    """Bucket boundaries below `current` (or the longest row when unbounded), the largest first."""
    top = current if current is not None else round_up(longest, multiple)
    return list(range((top - 1) // multiple * multiple, 0, -multiple))[:_MAX_CAPS]


def _sft_candidates(s: Settings, multiple: int) -> list[Candidate]:
    out = [Candidate(f"max_length {cap}", (("max_length", str(cap)),))
           for cap in _caps_below(s.max_length, s.longest_row, multiple)]
    if s.packing:
        out.append(Candidate("padded (no packing)", (("packing", "false"),)))
    else:
        if s.max_length is not None:
            out.append(Candidate("bfd packing", (("packing", "true"), ("packing_strategy", "bfd"))))
        if not s.padding_free:
            # TRL refuses padding_free without packing under a max_length: the padding-free run has none.
            out.append(Candidate("padding_free", (("padding_free", "true"), ("max_length", "none"))))
    if s.padding_free and not s.packing:
        out.append(Candidate("padded (no padding_free)", (("padding_free", "false"),)))
    return out


def _generation_candidates(s: Settings, multiple: int) -> list[Candidate]:
    out = []
    if s.pin_cache_len is not None:
        kwargs = pin_kwargs(s.generation_kwargs, s.pin_cache_len)
        out.append(Candidate(f"pin max_cache_len {s.pin_cache_len}", (("generation_kwargs", kwargs),)))
    if s.pads_tool_turns is False:
        out.append(Candidate("pad tool turns to the round's rows", (("pad_tool_turns", "true"),)))
    if s.max_completion_length is not None:
        out += [Candidate(f"max_completion_length {cap}", (("max_completion_length", str(cap)),),
                          caps_completions=True)
                for cap in _caps_below(s.max_completion_length, 0, multiple)]
    return out


def _batch_candidates(s: Settings) -> list[Candidate]:
    effective = s.per_device_train_batch_size * s.gradient_accumulation_steps
    out = []
    for batch in range(1, min(effective, _MAX_BATCH) + 1):
        if effective % batch == 0 and batch != s.per_device_train_batch_size:
            out.append(Candidate(f"batch {batch} x accumulation {effective // batch}",
                                 (("per_device_train_batch_size", str(batch)),
                                  ("gradient_accumulation_steps", str(effective // batch)))))
    return out


# --- results ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DataLoss:
    rows_dropped: int = 0  # more than the baseline drops
    rows_truncated: int = 0  # more than the baseline truncates
    tokens_lost: int = 0  # train tokens the baseline trains on and this does not
    completions_capped: int | None = None  # the new max_completion_length, when lowered

    @property
    def loses_data(self) -> bool:
        return bool(self.rows_dropped or self.rows_truncated or self.tokens_lost or self.completions_capped)

    def describe(self) -> str:
        parts = []
        if self.rows_truncated:
            parts.append(f"{self.rows_truncated:,} row{'s' * (self.rows_truncated != 1)} truncated")
        if self.rows_dropped:
            parts.append(f"{self.rows_dropped:,} row{'s' * (self.rows_dropped != 1)} dropped")
        if self.tokens_lost:
            parts.append(f"{self.tokens_lost:,} tokens lost")
        if self.completions_capped is not None:
            parts.append(f"completions cut at {self.completions_capped} tokens")
        return ", ".join(parts) or "none"


def data_loss(baseline: Plan, alternative: Plan, candidate: Candidate, *, lengths: Sequence[int], kind: LengthKind,
              baseline_max_length: int | None) -> DataLoss:
    """What `alternative` trains on less than `baseline`. `lengths`: the untruncated train rows (`kind` "rows") for
    counting truncated rows under a lower max_length."""
    truncated = 0
    new_max = dict(candidate.flags).get("max_length")
    # bfd packing truncates rows as padding does; bfd_split and wrapped packing keep every token.
    truncating = not alternative.config.get("packing") or alternative.config.get("packing_strategy") == "bfd"
    if new_max not in (None, "none") and kind == "rows" and truncating:
        cap, old = int(new_max), baseline_max_length
        truncated = sum(1 for n in lengths if cap < n and (old is None or n <= old))
    capped = int(dict(candidate.flags)["max_completion_length"]) if candidate.caps_completions else None
    return DataLoss(rows_dropped=max(0, alternative.stats.dropped_rows - baseline.stats.dropped_rows),
                    rows_truncated=truncated,
                    tokens_lost=max(0, baseline.stats.tokens - alternative.stats.tokens)
                    if kind == "rows" else 0,
                    completions_capped=capped)


@dataclass(frozen=True, slots=True)
class Option:
    """A planned what-if (or the baseline: `candidate` None) with its cost and the data it loses."""

    candidate: Candidate | None
    plan: Plan
    cost: PlanCost
    loss: DataLoss = DataLoss()

    @property
    def label(self) -> str:
        return self.candidate.label if self.candidate is not None else "baseline"


def ranked(options: Sequence[Option]) -> list[Option]:
    return sorted(options, key=lambda o: (o.cost.total_s, o.candidate is not None))


def recommendation(baseline: Option, options: Sequence[Option], *, allow_truncation: bool) -> tuple[Option | None,
                                                                                                  str]:
    """The fastest option that beats the baseline (and loses no data unless allowed), with one line saying so."""
    eligible = [o for o in ranked(options)
                if o.candidate is not None and (allow_truncation or not o.loss.loses_data)
                and o.cost.total_s < baseline.cost.total_s]
    if not eligible:
        lossy = [o for o in ranked(options) if o.loss.loses_data and o.cost.total_s < baseline.cost.total_s]
        hint = f" ({lossy[0].label} is faster but loses data; --allow-truncation to consider it)" if lossy else ""
        return None, f"recommendation: keep the current settings{hint}"
    best = eligible[0]
    saved = baseline.cost.total_s - best.cost.total_s
    assert best.candidate is not None
    loss = f"; loses {best.loss.describe()}" if best.loss.loses_data else ", no data lost"
    flags = best.candidate.command_line()
    named = "" if flags.replace("--", "") == best.label else f" ({best.label})"  # a label that only repeats the flags
    return best, (f"recommendation: {flags}{named}: saves {saved / 60:.1f} min "
                  f"({saved / baseline.cost.total_s:.0%}) of {baseline.cost.total_s / 60:.1f}{loss}")
