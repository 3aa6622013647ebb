"""Plans rendered for people. Returns strings; the CLI decides where they go."""

from __future__ import annotations

from .plan.cost import compile_minutes
from .plan.model import Plan, Shape


def _table(headers: list[str], rows: list[list[str]], *, text_columns: tuple[int, ...] = (0,)) -> str:
    """Numbers right-aligned, the `text_columns` left-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in text_columns else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _extra(shape: Shape) -> str:
    parts = []
    if shape.cache_len is not None:
        parts.append(f"cache {shape.cache_len}")
    if shape.max_new_tokens is not None:
        parts.append(f"new {shape.max_new_tokens}")
    if shape.logits_to_keep is not None:
        parts.append(f"keep {shape.logits_to_keep}")
    if shape.cu_seq_lens:
        parts.append(f"cu_seq_lens {_span(shape.cu_seq_lens)}")
    if shape.max_length_q:
        parts.append(f"max_length_q {_span(shape.max_length_q)}")
    if not shape.certain:
        parts.append("possible")
    return ", ".join(parts)


def _span(values: tuple[int, ...]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]} ({len(values)} values)"


def _minutes(minutes: float) -> str:
    return f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.1f} h"


def render_plan(plan: Plan) -> str:
    has_extra = any(_extra(s) for s in plan.shapes)
    headers = ["phase", "batch", "seq", "count", "first step"] + (["notes"] if has_extra else [])
    rows = [[s.phase, str(s.batch), str(s.seq), str(s.count), str(s.first_step)] + ([_extra(s)] if has_extra else [])
            for s in plan.shapes]
    st = plan.stats
    model = plan.config.get("model_name_or_path", "?")
    pad = plan.pad_to_multiple_of if plan.pad_to_multiple_of is not None else "none"
    lines = [
        f"{plan.method.upper()} plan for {model} (pad_to_multiple_of={pad}, "
        f"{plan.config.get('num_processes', 1)} process(es)){'' if plan.exact else ' — a bound, not exact'}",
        "",
        _table(headers, rows, text_columns=(0, 5)),
        "",
        f"rows: {st.rows:,}" + (f" ({st.dropped_rows:,} dropped in preparation)" if st.dropped_rows else "")
        + f"   micro-batches: {st.micro_batches:,}   optimizer steps: {st.optimizer_steps:,}",
        f"train tokens: {st.tokens:,} real of {st.padded_tokens:,} fed ({st.padding_waste:.1%} padding)",
        f"distinct shapes to compile: {plan.distinct_shapes}   estimated compile time: "
        f"{_minutes(compile_minutes(plan))} on one NeuronCore",
    ]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
