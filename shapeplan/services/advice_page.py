"""`advise --html`: one self-contained page to paste into a design review. The recommendation and the command that
runs it, the baseline run (its command, dataset and settings), the what-if table, the warnings, the token-length
histogram and the baseline's shapes. No external assets and no scripts, so it opens offline; it is well-formed XML
as well as HTML."""

from __future__ import annotations

import enum
import json
import re
import shlex
from collections.abc import Sequence
from html import escape
from typing import Any

from ..plan.model import Plan, Shape
from .advice_report import KV_CACHE, length_bins, length_cap, lengths_kind, minutes, what_if_headers, what_if_rows
from .advise import Advice
from .report import count_cell, shape_notes
from .trl_command import trl_options

# The run settings the page lists, in this order, when the plan's config has them.
_SETTINGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_processes", "num_train_epochs",
             "max_steps", "max_length", "packing", "packing_strategy", "padding_free", "max_completion_length",
             "num_generations", "cache_implementation", "generation_kwargs", "dtype", "torch_compile",
             "eval_strategy", "eval_steps")
_NUMERIC = {"shapes", "compile", "train", "total", "vs baseline", KV_CACHE}

_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#1f2328;line-height:1.45;
  max-width:1360px;margin:1.5em auto;padding:0 1.5em}
h1{font-size:1.55em;margin:0 0 .15em}
h2{font-size:1.2em;margin:1.8em 0 .6em;padding-bottom:.2em;border-bottom:1px solid #d1d9e0}
p.sub{color:#59636e;margin:0 0 1.2em}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace;font-size:12.5px}
pre.command{background:#f6f8fa;border:1px solid #d1d9e0;border-radius:6px;padding:.7em 1em;margin:.4em 0 1em;
  white-space:pre;overflow-x:auto}
.scroll{overflow-x:auto}
.run{display:flex;flex-wrap:wrap;gap:0 1.5em;align-items:flex-start}
.run pre.command{flex:0 0 auto;max-width:100%;margin-top:0}
mark{background:#aceebb;color:inherit}
td span,span.flag{white-space:nowrap}
table{border-collapse:collapse;font-size:14px}
th,td{border:1px solid #d1d9e0;padding:4px 9px;text-align:left;vertical-align:top}
th{background:#f6f8fa;font-weight:600}
th.num,td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td code{white-space:nowrap}
table.settings th{background:none;font-weight:normal;color:#59636e}
tr.baseline td{background:#f6f8fa}
tr.recommended td{background:#dafbe1;font-weight:600}
.badge{display:inline-block;padding:0 .5em;border-radius:1em;background:#1a7f37;color:#fff;
  font-size:11px;font-weight:600;vertical-align:1px}
.muted{color:#59636e}
.callout{border-left:4px solid #1a7f37;background:#f0fff4;border-radius:4px;padding:.6em 1em;margin:1em 0}
.callout.warning{border-left-color:#bf8700;background:#fff8c5}
.callout ul{margin:.2em 0;padding-left:1.2em}
"""


def command_lines(program: Sequence[str], argv: Sequence[str]) -> list[str]:
    """A shell command's lines: the program, then one option (with its value) per line. Joined by backslash
    continuations it reads well in a review and pastes into a shell as one command."""
    groups: list[list[str]] = [list(program)]
    for word in argv:
        if word.startswith("-") or len(groups) == 1:
            groups.append([word])
        else:
            groups[-1].append(word)
    return [" ".join(shlex.quote(w) for w in group) for group in groups]


_CONTINUATION = " \\\n  "


def _command_block(lines: Sequence[str], marked: int = 0) -> str:
    """`lines` as one copyable <pre> block; the last `marked` lines highlighted (what a change adds)."""
    plain = len(lines) - marked
    shown = [escape(line) if i < plain else f"<mark>{escape(line)}</mark>" for i, line in enumerate(lines)]
    return f'<pre class="command">{_CONTINUATION.join(shown)}</pre>'


def _given(argv: Sequence[str], name: str) -> str | None:
    """The value of `--name` in `argv` (`--name value` or `--name=value`), None when it is not given."""
    for i, word in enumerate(argv):
        if word == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(f"--{name}="):
            return word.split("=", 1)[1]
    return None


def _value(value: object) -> str:
    if isinstance(value, enum.Enum):  # TRL's str enums (IntervalStrategy.NO): the value the option takes, `no`
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _shown(name: str, config: dict[str, Any]) -> bool:
    """Whether the page lists a setting: the run has it, and no other setting switches it off."""
    value = config.get(name)
    if value is None:
        return False
    if name == "max_steps":
        return bool(value > 0)
    if name == "packing_strategy":
        return bool(config.get("packing"))
    if name == "eval_steps":
        return bool(config.get("eval_strategy") == "steps")
    return True


def _settings(advice: Advice) -> list[tuple[str, str]]:
    plan = advice.baseline.plan
    config = plan.config
    dataset = _given(advice.argv, "dataset_name") or (f"as set in {_given(advice.argv, 'config')}"
                                                      if _given(advice.argv, "config") else "-")
    rows = [("method", plan.method), ("model", str(config.get("model_name_or_path", "?"))), ("dataset", dataset)]
    if advice.eval_source is not None:
        rows.append(("eval dataset", advice.eval_source))
    rows.append(("pad_to_multiple_of", _value(plan.pad_to_multiple_of) if plan.pad_to_multiple_of else "none"))
    rows += [(name, _value(config[name])) for name in _SETTINGS if _shown(name, config)]
    st = plan.stats
    rows += [("rows", f"{st.rows:,}" + (f" ({st.dropped_rows:,} dropped)" if st.dropped_rows else "")),
             ("micro-batches / optimizer steps", f"{st.micro_batches:,} / {st.optimizer_steps:,}"),
             ("padding", f"{st.padding_waste:.1%} of the tokens fed")]
    return rows


def _settings_table(rows: list[tuple[str, str]]) -> str:
    """The settings two pairs a line, so the table stays about as tall as the command beside it."""
    half = -(-len(rows) // 2)
    pairs = [(rows[i], rows[i + half] if i + half < len(rows) else ("", "")) for i in range(half)]
    body = "".join("<tr>" + "".join(f"<th>{escape(name)}</th><td>{escape(value)}</td>" for name, value in pair)
                   + "</tr>" for pair in pairs)
    return f'<table class="settings"><tbody>{body}</tbody></table>'


def _what_if_table(advice: Advice) -> str:
    headers = what_if_headers(advice)
    head = "".join(f'<th class="num">{escape(h)}</th>' if h in _NUMERIC else f"<th>{escape(h)}</th>"
                   for h in headers)
    body = []
    for option, cells in zip([advice.baseline, *advice.options], what_if_rows(advice), strict=True):
        kind = "baseline" if option.candidate is None else "recommended" if option is advice.recommended else ""
        tds = []
        for header, cell in zip(headers, cells, strict=True):
            if header == "option" and kind == "recommended":
                tds.append(f'<td><span>{escape(cell)}</span> <span class="badge">recommended</span></td>')
            elif header == "option":
                tds.append(f"<td><span>{escape(cell)}</span></td>")
            elif header == headers[-1]:
                tds.append(f"<td><code>{escape(cell)}</code></td>" if option.candidate is not None
                           else f'<td class="muted">{escape(cell)}</td>')
            elif header == "data lost":  # wraps only between its clauses
                parts = cell.split(", ")
                tds.append("<td>" + " ".join(f"<span>{escape(p)}{',' if i < len(parts) - 1 else ''}</span>"
                                             for i, p in enumerate(parts)) + "</td>")
            else:
                tds.append(f'<td class="num">{escape(cell)}</td>' if header in _NUMERIC else f"<td>{escape(cell)}</td>")
        row_class = f' class="{kind}"' if kind else ""
        body.append(f"<tr{row_class}>{''.join(tds)}</tr>")
    return (f'<div class="scroll"><table class="what-if"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


# The shape table's columns beyond (phase, batch, seq): a graph key's generate sizes, each shown when a shape has it.
_SIZE_COLUMNS = (("cache length", "cache_len"), ("new tokens", "max_new_tokens"), ("logits kept", "logits_to_keep"))


def _shape_table(plan: Plan) -> str:
    sizes = [(header, field) for header, field in _SIZE_COLUMNS
             if any(getattr(s, field) is not None for s in plan.shapes)]
    notes = any(shape_notes(s) for s in plan.shapes)
    headers = ["batch", "seq", *(h for h, _ in sizes), "count", "first step"]
    head = ("<th>phase</th>" + "".join(f'<th class="num">{h}</th>' for h in headers)
            + ("<th>notes</th>" if notes else ""))

    def row(shape: Shape) -> str:
        values = [shape.batch, shape.seq, *(getattr(shape, f) for _, f in sizes), count_cell(shape), shape.first_step]
        cells = "".join(f'<td class="num">{"" if v is None else escape(str(v))}</td>' for v in values)
        note = f"<td>{escape(shape_notes(shape))}</td>" if notes else ""
        return f"<tr><td>{escape(shape.phase)}</td>{cells}{note}</tr>"

    return (f'<div class="scroll"><table class="shapes"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(row(s) for s in plan.shapes)}</tbody></table></div>")


def _svg_histogram(advice: Advice) -> str:
    cap = length_cap(advice.baseline.plan)
    bins = length_bins(advice.lengths, advice.baseline.plan.pad_to_multiple_of, cap)
    width, plot_h, left, top = 880, 260, 40, 24
    bar = (width - 2 * left) / max(len(bins), 1)
    rotate = bar < 56  # upright labels overlap below this bar width
    bottom = 112 if rotate else 56
    most = max((c for _, _, c in bins), default=0) or 1
    base_y = top + plot_h
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{base_y + bottom}" '
             f'viewBox="0 0 {width} {base_y + bottom}" font-family="system-ui,DejaVu Sans,sans-serif" role="img" '
             f'aria-label="{escape(lengths_kind(advice))} per pad bucket">']
    for i, (low, high, count) in enumerate(bins):
        h = plot_h * count / most
        x = left + i * bar
        over = cap is not None and low >= cap and i == len(bins) - 1
        label = f"&gt;{cap}" if over else f"{low + 1}-{high}"
        parts.append(f'<rect x="{x + 1:.1f}" y="{base_y - h:.1f}" width="{bar - 2:.1f}" height="{h:.1f}" '
                     f'fill="{"#cf222e" if over else "#4a78b0"}"><title>{label} tokens: {count} '
                     f'{escape(lengths_kind(advice))}</title></rect>')
        parts.append(f'<text x="{x + bar / 2:.1f}" y="{base_y - h - 5:.1f}" font-size="13" text-anchor="middle" '
                     f'fill="#1f2328">{count:,}</text>')
        cx = x + bar / 2
        if rotate:
            parts.append(f'<text x="{cx:.1f}" y="{base_y + 14}" font-size="13" text-anchor="end" fill="#1f2328" '
                         f'transform="rotate(-45 {cx:.1f} {base_y + 14})">{label}</text>')
        else:
            parts.append(f'<text x="{cx:.1f}" y="{base_y + 20}" font-size="13" text-anchor="middle" '
                         f'fill="#1f2328">{label}</text>')
    parts.append(f'<line x1="{left}" y1="{base_y}" x2="{width - left}" y2="{base_y}" stroke="#59636e"/>')
    pad = advice.baseline.plan.pad_to_multiple_of
    parts.append(f'<text x="{width / 2:.1f}" y="{base_y + bottom - 8}" font-size="14" text-anchor="middle" '
                 f'fill="#59636e">tokens per {escape(lengths_kind(advice)[:-1])}, by pad bucket '
                 f'(pad_to_multiple_of={pad or "none"}{f", max_length={cap}" if cap is not None else ""})</text></svg>')
    return "".join(parts)


def _unbroken_flags(text: str) -> str:
    """`text` escaped, each `--flag` in it kept on one line."""
    return re.sub(r"--[\w-]+", lambda m: f'<span class="flag">{m.group(0)}</span>', escape(text))


def render_html(advice: Advice) -> str:
    plan = advice.baseline.plan
    cost = advice.baseline.cost
    model = str(plan.config.get("model_name_or_path", "?"))
    title = f"shapeplan advise: {advice.method.upper()} {model}"
    program, baseline_argv = advice.command.words[:2], advice.command.words[2:]
    recommended = advice.recommended_command()
    if recommended is not None and advice.recommended is not None and advice.recommended.candidate is not None:
        lines = command_lines(program, recommended.words[2:])
        run_it = (f"<p>Run it (the change highlighted):</p>"
                  f"{_command_block(lines, len(trl_options(advice.recommended.candidate.flags)))}")
    else:
        run_it = ""
    run_it += "".join(f'<p class="muted">{_unbroken_flags(note)}</p>' for note in (recommended or advice.command).notes)
    per_phase = ", ".join(f"{phase} {n}" for phase, n in cost.shapes_per_phase.items())
    skipped = "".join(f"<li>{escape(label)}: {escape(why)}</li>" for label, why in advice.skipped)
    warnings = "".join(f"<li>{_unbroken_flags(w)}</li>" for w in advice.warnings)
    return (
        '<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/xhtml" lang="en"><head><meta charset="utf-8"/>'
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{escape(title)}</h1>"
        f'<p class="sub">{escape(lengths_kind(advice))}: {len(advice.lengths):,}; cost model: '
        f"{escape(advice.model.source)}</p>"
        f'<div class="callout"><strong>{escape(advice.recommendation)}</strong>{run_it}</div>'
        + (f'<div class="callout warning"><strong>Warnings</strong><ul>{warnings}</ul></div>' if warnings else "")
        + "<h2>Baseline run</h2>"
        f'<div class="run">{_command_block(command_lines(program, baseline_argv))}'
        f"{_settings_table(_settings(advice))}</div>"
        f"<p>Distinct shapes: {escape(per_phase)}. Compile {minutes(cost.compile_s)} min + training "
        f"{minutes(cost.train_s)} min = <strong>{minutes(cost.total_s)} min</strong>.</p>"
        "<h2>What-if (minutes, fastest first)</h2>"
        "<p>Each row is one change: append its flags to the baseline command. Shapes are distinct compiled "
        "graphs.</p>"
        f"{_what_if_table(advice)}"
        + (f"<p>Not planned:</p><ul>{skipped}</ul>" if skipped else "")
        + f"<h2>Token lengths ({escape(lengths_kind(advice))})</h2>{_svg_histogram(advice)}"
        f"<h2>Baseline plan shapes</h2>{_shape_table(plan)}"
        "</body></html>\n"
    )
