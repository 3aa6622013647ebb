"""Advice and token-length histograms rendered for people (terminal text, one self-contained HTML page) and for
machines (a JSON-ready dict). Returns strings; the CLI decides where they go."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .advise import Advice
from .plan.advice import Option
from .plan.buckets import round_up
from .plan.io import shape_to_dict
from .plan.model import Plan
from .report import table
from .trainers import trainer_spec

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


def _what(advice: Advice) -> str:
    return str(trainer_spec(advice.method).lengths)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def _rows(advice: Advice) -> list[list[str]]:
    base = advice.baseline.cost.total_s
    out = []
    for option in [advice.baseline, *advice.options]:
        c = option.cost
        flags = option.candidate.command_line() if option.candidate is not None else "(as given)"
        change = "" if option.candidate is None else f"{(c.total_s - base) / 60:+.1f} min"
        out.append([option.label, str(sum(c.shapes_per_phase.values())), _minutes(c.compile_s), _minutes(c.train_s),
                    _minutes(c.total_s), change, option.loss.describe(), flags])
    return out


_HEADERS = ["option", "shapes", "compile", "train", "total", "vs baseline", "data lost", "TRL flags"]


def render_advice(advice: Advice) -> str:
    plan = advice.baseline.plan
    cost = advice.baseline.cost
    per_phase = ", ".join(f"{phase} {n}" for phase, n in cost.shapes_per_phase.items())
    lines = [
        f"{advice.method.upper()} advice for {plan.config.get('model_name_or_path', '?')}",
        "",
        histogram(advice.lengths, plan.pad_to_multiple_of, _cap(advice), what=_what(advice)),
        "",
        f"baseline: {per_phase} distinct shapes; compile {_minutes(cost.compile_s)} min + training "
        f"{_minutes(cost.train_s)} min = {_minutes(cost.total_s)} min",
        f"cost model: {advice.model.source}",
        "",
        "what-if (minutes, fastest first):",
        table(_HEADERS, _rows(advice), text_columns=(0, 6, 7)),
        "",
        *(f"not planned: {label}: {why}" for label, why in advice.skipped),
        advice.recommendation,
    ]
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
        "shapes": [shape_to_dict(s) for s in option.plan.shapes],
    }


def advice_to_dict(advice: Advice) -> dict[str, Any]:
    base = advice.baseline.cost.total_s
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
        "histogram": [{"low": low, "high": high, "rows": rows}
                      for low, high, rows in length_bins(advice.lengths, advice.baseline.plan.pad_to_multiple_of,
                                                         _cap(advice))],
        "warnings": list(advice.warnings),
    }


def _svg_histogram(advice: Advice) -> str:
    bins = length_bins(advice.lengths, advice.baseline.plan.pad_to_multiple_of, _cap(advice))
    width, height, pad = 720, 240, 30
    bar = (width - 2 * pad) / max(len(bins), 1)
    most = max((c for _, _, c in bins), default=0) or 1
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 40}" '
             f'role="img" aria-label="token length histogram">']
    for i, (low, high, count) in enumerate(bins):
        h = (height - pad) * count / most
        x = pad + i * bar
        parts.append(f'<rect x="{x:.1f}" y="{height - h:.1f}" width="{bar - 2:.1f}" height="{h:.1f}" fill="#4a78b0">'
                     f'<title>{low + 1}-{high}: {count} {_what(advice)}</title></rect>')
        parts.append(f'<text x="{x + bar / 2:.1f}" y="{height + 14}" font-size="9" text-anchor="middle">{high}</text>')
        parts.append(f'<text x="{x + bar / 2:.1f}" y="{height - h - 3:.1f}" font-size="9" '
                     f'text-anchor="middle">{count}</text>')
    parts.append(f'<text x="{pad}" y="{height + 34}" font-size="11">bucket upper edge (tokens)</text></svg>')
    return "".join(parts)


def _html_table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(advice: Advice) -> str:
    """One self-contained page: inline SVG histogram, the what-if table, the baseline's shape table. No external
    assets and no scripts, so it opens offline; it is well-formed XML as well as HTML."""
    plan = advice.baseline.plan
    title = f"shapeplan advise: {advice.method.upper()} {plan.config.get('model_name_or_path', '')}"
    shape_rows = [[s.phase, str(s.batch), str(s.seq), str(s.count), str(s.first_step)] for s in plan.shapes]
    warnings = "".join(f"<li>{html.escape(w)}</li>" for w in advice.warnings)
    return (
        '<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/xhtml" lang="en"><head><meta charset="utf-8"/>'
        f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;margin:2em}}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
        "td:first-child,th:first-child{text-align:left}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<h2>Token lengths ({_what(advice)})</h2>{_svg_histogram(advice)}"
        f"<h2>What-if (minutes, fastest first)</h2>{_html_table(_HEADERS, _rows(advice))}"
        f"<p><strong>{html.escape(advice.recommendation)}</strong></p>"
        f"<p>Cost model: {html.escape(advice.model.source)}</p>"
        + (f"<h2>Warnings</h2><ul>{warnings}</ul>" if warnings else "")
        + f"<h2>Baseline plan shapes</h2>{_html_table(['phase', 'batch', 'seq', 'count', 'first step'], shape_rows)}"
        "</body></html>\n"
    )
