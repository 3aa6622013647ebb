"""Advice and token-length histograms rendered for people (terminal text; the HTML page is `advice_page.py`) and
for machines (a JSON-ready dict). Returns strings; the CLI decides where they go."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ..plan.advice import Option
from ..plan.buckets import round_up
from ..plan.io import shape_to_dict
from ..plan.kv_cache import peak_bytes
from ..plan.model import Plan
from .advise import Advice
from .report import table
from .trainers import trainer_spec
from .vision_advice import VisionAdvice

WIDTH = 80
_MAX_BINS = 24
_BIN = 128  # bin width when there is no pad_to_multiple_of


def length_bins(lengths: Sequence[int], multiple: int | None, cap: int | None) -> list[tuple[int, int, int]]:
    """(low, high, rows) per bin: bins are the pad buckets (merged by whole buckets to at most 24), rows longer than
    `cap` (truncated or split by max_length) counted in a last bin (cap, longest]."""
    step = multiple or _BIN
    kept = [n for n in lengths if cap is None or n <= cap]
    top = round_up(max(kept, default=step), step)
    width = step * max(1, -(-top // step // _MAX_BINS))
    bins = [(low, low + width, 0) for low in range(0, top, width)]
    counts = [0] * len(bins)
    for n in kept:
        counts[min(max(n - 1, 0) // width, len(bins) - 1)] += 1
    out = [(low, high, c) for (low, high, _), c in zip(bins, counts, strict=True)]
    over = [n for n in lengths if cap is not None and n > cap]
    if over:
        out.append((cap or 0, max(over), len(over)))
    return out


def histogram(lengths: Sequence[int], multiple: int | None, cap: int | None, *, what: str) -> str:
    """A terminal histogram (at most 80 columns) with the bucket edges and rows per bucket."""
    bins = length_bins(lengths, multiple, cap)
    labels = [f"{low + 1:>6}-{high:<6}" + (" >max" if cap is not None and low >= cap and i == len(bins) - 1 else "")
              for i, (low, high, _) in enumerate(bins)]
    label_w = max(len(label) for label in labels)
    count_w = max(len(f"{c:,}") for _, _, c in bins)
    bar_w = WIDTH - label_w - count_w - 4
    most = max((c for _, _, c in bins), default=0) or 1
    cap_text = f", max_length={cap}" if cap is not None else ""
    lines = [f"{what} per bucket (pad_to_multiple_of={multiple or 'none'}{cap_text}, tokens):"]
    for label, (_, _, count) in zip(labels, bins, strict=True):
        bar = "#" * round(bar_w * count / most)
        lines.append(f"{label:<{label_w}} |{bar:<{bar_w}} {count:>{count_w},}")
    return "\n".join(lines)


def length_cap(plan: Plan) -> int | None:
    """The max_length a histogram of `plan`'s token lengths marks: the cap on the train rows, when those are what
    its method's lengths count."""
    return plan.config.get("max_length") if trainer_spec(plan.method).lengths == "rows" else None


def _cap(advice: Advice) -> int | None:
    return length_cap(advice.baseline.plan)


def lengths_kind(advice: Advice) -> str:
    """What the advice's token lengths count: rows or prompts."""
    return str(trainer_spec(advice.method).lengths)


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


WHAT_IF_HEADERS = ["option", "shapes", "compile", "train", "total", "vs baseline", "data lost", "TRL flags"]
KV_CACHE = "KV cache"  # the static cache's peak, where the run generates with one


def what_if_headers(advice: Advice) -> list[str]:
    """WHAT_IF_HEADERS, with the static cache's peak before "data lost" where the baseline generates with one."""
    if peak_bytes(advice.baseline.plan) is None:
        return list(WHAT_IF_HEADERS)
    at = WHAT_IF_HEADERS.index("data lost")
    return [*WHAT_IF_HEADERS[:at], KV_CACHE, *WHAT_IF_HEADERS[at:]]


def gib(size: int | None) -> str:
    return "" if size is None else f"{size / 1024 ** 3:.2f} GiB" if size >= 1024 ** 3 / 100 else \
        f"{size / 1024 ** 2:.2f} MiB"


def what_if_rows(advice: Advice) -> list[list[str]]:
    """One row of `what_if_headers` cells per option: the baseline first, then the alternatives, fastest first."""
    base = advice.baseline.cost.total_s
    memory = KV_CACHE in what_if_headers(advice)
    out = []
    for option in [advice.baseline, *advice.options]:
        c = option.cost
        flags = option.candidate.command_line() if option.candidate is not None else "(as given)"
        change = "" if option.candidate is None else f"{(c.total_s - base) / 60:+.1f} min"
        out.append([option.label, str(sum(c.shapes_per_phase.values())), minutes(c.compile_s), minutes(c.train_s),
                    minutes(c.total_s), change, *([gib(peak_bytes(option.plan))] if memory else []),
                    option.loss.describe(), flags])
    return out


def render_advice(advice: Advice) -> str:
    plan = advice.baseline.plan
    headers = what_if_headers(advice)
    cost = advice.baseline.cost
    per_phase = ", ".join(f"{phase} {n}" for phase, n in cost.shapes_per_phase.items())
    lines = [
        f"{advice.method.upper()} advice for {plan.config.get('model_name_or_path', '?')}",
        "",
        histogram(advice.lengths, plan.pad_to_multiple_of, _cap(advice), what=lengths_kind(advice)),
        "",
        f"baseline: {per_phase} distinct shapes; compile {minutes(cost.compile_s)} min + training "
        f"{minutes(cost.train_s)} min = {minutes(cost.total_s)} min",
        f"cost model: {advice.model.source}",
        "",
        "what-if (minutes, fastest first):",
        table(headers, what_if_rows(advice), text_columns=(0, headers.index("data lost"), len(headers) - 1)),
        "",
        *(f"not planned: {label}: {why}" for label, why in advice.skipped),
        advice.recommendation,
    ]
    command = advice.recommended_command()
    if command is not None:
        lines.append(f"run it: {command.line()}")
    lines += [f"note: {note}" for note in (command or advice.command).notes]
    lines += [f"warning: {w}" for w in advice.warnings]
    return "\n".join(lines)


def _option_dict(option: Option, base_total: float) -> dict[str, Any]:
    c = option.cost
    return {
        "option": option.label,
        "flags": option.candidate.argv() if option.candidate is not None else [],
        "shapes_per_phase": c.shapes_per_phase,
        "compile_seconds": round(c.compile_s, 3),
        "train_seconds": round(c.train_s, 3),
        "total_seconds": round(c.total_s, 3),
        "change_seconds": round(c.total_s - base_total, 3),
        "data_lost": {**asdict(option.loss), "loses_data": option.loss.loses_data},
        "kv_cache_peak_bytes": peak_bytes(option.plan),
        "shapes": [shape_to_dict(s, option.plan.config) for s in option.plan.shapes],
    }


def advice_to_dict(advice: Advice) -> dict[str, Any]:
    base = advice.baseline.cost.total_s
    recommended = advice.recommended_command()
    return {
        "method": advice.method,
        "argv": list(advice.argv),
        "cost_model": advice.model.to_dict(),
        "baseline": _option_dict(advice.baseline, base),
        "alternatives": [_option_dict(o, base) for o in advice.options],
        "skipped": [{"option": label, "reason": why} for label, why in advice.skipped],
        "recommended": (advice.recommended.candidate.argv()
                        if advice.recommended is not None and advice.recommended.candidate is not None else None),
        "recommendation": advice.recommendation,
        "command": list(advice.command.words),
        "recommended_command": list(recommended.words) if recommended is not None else None,
        "notes": list((recommended or advice.command).notes),
        "histogram": [{"low": low, "high": high, "rows": rows}
                      for low, high, rows in length_bins(advice.lengths, advice.baseline.plan.pad_to_multiple_of,
                                                         _cap(advice))],
        "warnings": list(advice.warnings),
    }


def render_vision_advice(advice: VisionAdvice) -> str:
    """Vision advice for people: the vision graphs as given and under each what-if, and how to apply the best."""
    plan = advice.baseline.plan
    rows = [[option.label, str(option.plan.vision_graphs), str(option.plan.distinct_shapes),
             f"{option.compile_minutes:.0f}", f"{option.pixels_kept:.1%}"]
            for option in (advice.baseline, *advice.options)]
    lines = [
        f"{advice.method.upper()} vision advice for {plan.config.get('model_name_or_path', '?')}",
        "",
        f"as given: {plan.vision_graphs} vision graphs: each distinct image batch (its images' keys and pixel "
        "tensor) is a compile of the vision tower",
        "",
        "what-if: each setting of the processor, or resize of the images, that fixes their keys (with fixed sizes, "
        "every image resized to the fixed size (height x width) nearest its aspect ratio)",
        table(["images", "vision graphs", "shapes", "compile min", "pixels kept"], rows),
        "",
    ]
    best = advice.best
    if best is None:
        lines.append("no what-if compiles less than the images as given")
    else:
        setting = best.setting
        assert setting is not None  # only a what-if is best
        how = ("set the processor's limits:" if setting.pixel_limits is not None else
               "resize the dataset before training with (height, width) pairs:" if setting.sizes else "apply it:")
        lines += [f"fewest compiles: {best.label}, {best.plan.vision_graphs} vision graphs instead of "
                  f"{plan.vision_graphs}, keeping {best.pixels_kept:.1%} of the pixels; {how}",
                  f"  {setting.apply}"]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)

