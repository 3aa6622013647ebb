"""Plans and warm reports rendered for people. Returns strings; the CLI decides where they go."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..plan.cost import GENERATE_SHAPE_MINUTES, compile_minutes
from ..plan.grpo import cache_pin, pin_kwargs, pinned_cache
from ..plan.io import keys_tensor
from ..plan.model import GENERATE_PHASES, Plan, Shape, shape_key
from ..warm.model import WarmReport, WarmResult

if TYPE_CHECKING:
    from .trl_command import TrlCommand


def table(headers: list[str], rows: list[list[str]], *, text_columns: tuple[int, ...] = (0,)) -> str:
    """Numbers right-aligned, the `text_columns` left-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in text_columns else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _extra(shape: Shape, sliding_window: int | None = None) -> str:
    """The notes of a shape; `sliding_window`: the model's sliding layers' window, whose static cache is the lesser
    of it and the cache length."""
    parts = []
    if shape.cache_len is not None:
        sliding = f" (sliding layers {min(sliding_window, shape.cache_len)})" if sliding_window else ""
        parts.append(f"cache {shape.cache_len}{sliding}")
    if shape.max_new_tokens is not None:
        parts.append(f"new {shape.max_new_tokens}")
    if shape.logits_to_keep is not None:
        parts.append(f"keep {shape.logits_to_keep}")
    notes = shape_notes(shape)
    return ", ".join([*parts, notes] if notes else parts)


def shape_notes(shape: Shape) -> str:
    """What a shape carries beyond its graph key (the padding-free values, DPO/KTO's counts, a possible bucket)."""
    parts = []
    if shape.cu_seq_lens:
        parts.append(f"cu_seq_lens {_span(shape.cu_seq_lens)}")
    if shape.max_length_q:
        parts.append(f"max_length_q {_span(shape.max_length_q)}")
    if shape.completion_tokens:
        parts.append(f"completion tokens {_span(shape.completion_tokens)}")
    if shape.chosen_rows:
        parts.append(f"chosen rows {_span(shape.chosen_rows)}")
    if shape.pixel_values is not None:
        parts.append(f"pixel_values {'x'.join(map(str, shape.pixel_values))}, "
                     f"{len(shape.images)} image{'s' if len(shape.images) > 1 else ''}")
        parts += [f"{name} {'x'.join(map(str, dims))}" for name, dims in shape.vision_inputs]
    if not shape.certain:
        parts.append("possible")
    if shape.max_count is not None:
        parts.append(f"up to {shape.max_count} with tool calls")
    return ", ".join(parts)


def count_cell(shape: Shape) -> str:
    """A shape's count as a table shows it: `<=N` where N is only the most the run can meet (a shape only sampling
    or tool calls can produce)."""
    return str(shape.count) if shape.certain else f"<={shape.count}"


def _span(values: tuple[int, ...]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]} ({len(values)} values)"


def _minutes(minutes: float) -> str:
    return f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.1f} h"


def _generate_lines(plan: Plan, generate_minutes: float) -> list[str]:
    """The generate sizes and what they cost to compile; what pinning the static cache length saves."""
    generate = [s for s in plan.shapes if s.phase in GENERATE_PHASES]
    if not generate:
        return []
    sizes = {s.key for s in generate}
    if any(s.cache_len is None for s in generate):
        return [f"generate sizes: {len(sizes)} (batch, prompt bucket) with a dynamic cache: every decode step is "
                f"a new shape, up to {max(s.max_new_tokens or 1 for s in generate) - 1} per size; the estimate "
                "counts one compile per size"]
    lines = [f"generate sizes: {len(sizes)} (batch, prompt bucket, cache length), "
             f"{_minutes(len(sizes) * generate_minutes)} to compile at {generate_minutes:g} min each"]
    pin = cache_pin(plan.shapes)
    if pin is not None:
        lines.append(f"pinning max_cache_len={pin.max_cache_len} leaves {pin.pinned_graphs} generate sizes and saves "
                     f"{_minutes(pin.saved * generate_minutes)} of compile")
    return lines


def _agentic_lines(plan: Plan) -> list[str]:
    """How wide the bound of an agentic run is (tools, environments, a rollout function): its possible entries, which
    the model's calls decide, against its certain ones."""
    if not (plan.config.get("tool_turns") or plan.config.get("rollout_func")):  # GRPO records 0 turns without tools
        return []
    certain = sum(s.certain for s in plan.shapes)
    possible = len(plan.shapes) - certain
    ratio = f" ({possible / certain:.1f} to 1)" if certain else ""
    return [f"agentic bound: {possible} possible entries to {certain} certain{ratio}, each met only if the model's "
            "calls lead there"]


def _vision_lines(plan: Plan) -> list[str]:
    """How many vision-tower graphs the run needs: one per distinct image batch (its images' keys and pixel shape)."""
    if not plan.vision_graphs:
        return []
    family = plan.config.get("vision_family", "qwen2_vl")
    lines = [f"vision graphs: {plan.vision_graphs} distinct image batches ({family}: each batch's image keys and "
             "pixel tensor), each a compile of the vision tower"]
    layouts = sum(len(s.text_runs) for s in plan.shapes)
    if layouts:
        lines.append(f"row layouts: {layouts} (each row's text runs around its images; Qwen-VL builds its position "
                     "ids from them op by op); `warm` runs one batch of each")
    return lines


def render_plan(plan: Plan, *, generate_minutes: float = GENERATE_SHAPE_MINUTES) -> str:
    sliding = plan.config.get("sliding_window")
    has_extra = any(_extra(s) for s in plan.shapes)
    headers = ["phase", "batch", "seq", "count", "first step"] + (["notes"] if has_extra else [])
    rows = [[s.phase, str(s.batch), str(s.seq), count_cell(s), str(s.first_step)]
            + ([_extra(s, sliding)] if has_extra else []) for s in plan.shapes]
    st = plan.stats
    generate_lines = _generate_lines(plan, generate_minutes)
    generating = bool(generate_lines)
    model = plan.config.get("model_name_or_path", "?")
    pad = plan.pad_to_multiple_of if plan.pad_to_multiple_of is not None else "none"
    lines = [
        f"{plan.method.upper()} plan for {model} (pad_to_multiple_of={pad}, "
        f"{plan.config.get('num_processes', 1)} process(es)){'' if plan.exact else ' — a bound, not exact'}",
        *([f"planned from `{shlex.join(plan.config['command'])}`: the {plan.config['trainer']} it trains"]
          if isinstance(plan.config.get("command"), list) and "trainer" in plan.config else []),
        "",
        table(headers, rows, text_columns=(0, 5)),
        "",
        f"rows: {st.rows:,}" + (f" ({st.dropped_rows:,} dropped in preparation)" if st.dropped_rows else "")
        + f"   micro-batches: {st.micro_batches:,}   optimizer steps: {st.optimizer_steps:,}",
        f"{'generate prompt' if generating else 'train'} tokens: {st.tokens:,} real of {st.padded_tokens:,} fed "
        f"({st.padding_waste:.1%} padding)",
        *generate_lines,
        *_agentic_lines(plan),
        *_vision_lines(plan),
        f"distinct shapes to compile: {plan.distinct_shapes}   estimated compile time: "
        f"{_minutes(compile_minutes(plan, generate_minutes=generate_minutes))} on one NeuronCore",
    ]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def result_row(result: WarmResult) -> str:
    """One warmed shape: its status, task, seconds and compile-counter changes (and error, if it failed)."""
    counters = " ".join(f"{k}={v:+d}" for k, v in sorted(result.counters.items()))
    text = f"{result.status:<9} {result.task.label:<22} {result.seconds:8.1f}s  {counters}"
    return text + (f"  {result.error}" if result.error else "")


def render_warm(report: WarmReport, *, verify: bool, command: TrlCommand | None = None,
                env_file: str | None = None, rows: bool = True) -> str:
    """A warm-up's (or, with `verify`, a verification's) rows (unless `rows` is False: shown already), summary,
    warnings and the script lines; with `command`, the training command to run next (after sourcing `env_file`,
    when one was written)."""
    lines = [result_row(r) for r in report.results] if rows else []
    if report.covered:  # every planned shape is reported: these ran inside the steps of the rows' tasks
        phases: dict[str, list[str]] = {}
        for phase, batch, seq in report.covered:
            phases.setdefault(phase, []).append(f"({batch}, {seq})")
        lines.append("also warmed, inside the steps of the shapes above:")
        lines += [f"  {phase:<13} {' '.join(shapes)}" for phase, shapes in phases.items()]
    if lines:
        lines.append("")
    summary = report.to_dict()["summary"]
    lines.append(", ".join(f"{n} {s}" for s, n in summary.items() if n) + f"  (cache: {report.cache_dir})")
    if report.shard:
        lines.append(f"shard {report.shard.label} (from {report.shard.source})")
    if verify and report.eager:
        lines.append(f"verify: nothing to compile: eager {report.device} runs no compiler, so this shows that the "
                     "shapes run and proves nothing about the cache")
    elif verify:
        lines.append("verify: nothing compiled" if not report.compiled and not report.failed else
                     f"verify: {len(report.compiled)} shape(s) compiled, {len(report.failed)} failed")
    elif report.eager:
        lines.append(f"eager {report.device} runs no compiler: the shapes ran, nothing was compiled or cached")
    if report.eager:
        lines.append("to warm a compile cache, warm with --torch_compile true (Inductor) or on --device neuron")
    lines += [f"warning: {w}" for w in report.warnings]
    if report.script_lines:
        lines.append("")
        lines.append("Set these in the training script (and its environment) to hit this cache:")
        lines += [f"  export {name}={shlex.quote(value)}" for name, value in report.environment_variables.items()]
        lines += [f"  {line}" for line in report.script_lines if not line.startswith("export ")]
    if command is not None:
        lines.append("")
        lines.append("Then train with:")
        # `.` looks a name without a slash up in PATH, not in the current folder
        where = env_file if env_file is None or "/" in env_file else f"./{env_file}"
        source = f". {shlex.quote(where)} && " if where is not None else ""
        lines.append(f"  {source}{command.line()}")
        lines += [f"note: {note}" for note in command.notes]
    return "\n".join(lines)


def render_env_file(report: WarmReport) -> str:
    """The warm-up's environment variables as a file a shell (a Packer, systemd or Kubernetes step) can source.
    Every value is shell-quoted and no comment holds a path or a line break, so sourcing it sets these variables
    and runs nothing else, whatever the cache dir's name holds."""
    from ..warm.backends.inductor import python_only

    lines = ["# from `shapeplan warm`: source this before training to hit the cache it warmed",
             *(f"export {name}={shlex.quote(value)}" for name, value in report.environment_variables.items())]
    script = python_only(report.script_lines)
    if script:
        lines.append("# no environment variable sets these: the training script must run them before training")
        lines += [f"# {' '.join(line.splitlines())}" for line in script]
    return "".join(f"{line}\n" for line in lines)


def render_comparison(plan: Plan, observed: Plan) -> str:
    """The plan against a run record (`shapeplan guard --record`): each shape's planned and met counts and first
    steps, and whether it held (`as planned`, `count differs`, `not met`, `unplanned`; a bound's shapes are only met
    or not)."""
    keyed = keys_tensor(plan.config) is not None  # else the run's images show only in their tensors' shapes
    met = {shape_key(s): s for s in observed.shapes}  # max_new_tokens is a setting, not seen by the run
    planned = {shape_key(s, images=keyed): s for s in plan.shapes}
    rows = []
    for key in [*planned, *(k for k in met if k not in planned)]:
        p, m = planned.get(key), met.get(key)
        shape = p or m
        assert shape is not None
        if p is None:
            status = "unplanned"
        elif m is None:
            status = "not met" if p.certain else "not met (possible)"
        elif not plan.exact or not p.certain:
            status = "met"
        elif p.max_count is not None:  # tool calls can add to it, and meet it before its certain first step
            status = "as planned" if p.count <= m.count <= p.max_count else "count differs"
        else:
            status = "as planned" if (m.count, m.first_step) == (p.count, p.first_step) else "count differs"
        planned_count = "-" if p is None else count_cell(p) if p.max_count is None else f"{p.count}..{p.max_count}"
        rows.append([shape.phase, str(shape.batch), str(shape.seq), planned_count,
                     str(p.first_step) if p else "-", str(m.count) if m else "-", str(m.first_step) if m else "-",
                     status, _extra(shape)])
    held = sum(r[7] in ("as planned", "met") for r in rows)
    headers = ["phase", "batch", "seq", "planned", "first step", "met", "first step", "status", "notes"]
    return "\n".join([
        f"{plan.method.upper()} plan against the run record ({observed.stats.optimizer_steps} optimizer steps run, "
        f"{plan.stats.optimizer_steps} planned)", "", table(headers, rows, text_columns=(0, 7, 8)), "",
        f"{held}/{len(rows)} shapes as planned, {sum(r[7] == 'unplanned' for r in rows)} unplanned, "
        f"{sum(r[7].startswith('not met') for r in rows)} not met", *_unpinned(plan, observed, planned)])


def _unpinned(plan: Plan, observed: Plan, planned: Mapping[Any, Shape]) -> list[str]:
    """Why a run of a plan that pins the cache (`pin_cache`) met generate calls at other cache lengths: it ran
    without the pin."""
    pin = pinned_cache(plan)
    other = sorted({s.cache_len for s in observed.shapes if s.phase in GENERATE_PHASES and s.cache_len is not None
                    and s.cache_len != pin and shape_key(s) not in planned})
    if pin is None or not other:
        return []
    kwargs = pin_kwargs(plan.config.get("generation_kwargs") or {}, pin)
    return [f"the run generated at cache lengths {', '.join(map(str, other))}, and the plan is of a run whose cache is "
            f"pinned at {pin} (its pin_cache): run it under `shapeplan guard --plan PLAN`, which pins it, or pass "
            f"--generation_kwargs '{kwargs}'"]
