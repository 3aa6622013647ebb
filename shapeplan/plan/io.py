"""The plan file: a JSON contract other tools read (documented in the README). The schema lives here only."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import PlanFileError
from .model import Plan, PlanStats, Shape

PLAN_SCHEMA = 1

# Optional shape fields, written only when not their default.
_OPTIONAL = ("cache_len", "max_new_tokens", "logits_to_keep", "cu_seq_lens", "max_length_q", "varlen_pairs",
             "unpadded", "completion_tokens", "chosen_rows")
_DEFAULTS = {f.name: f.default for f in fields(Shape)}


def shape_to_dict(shape: Shape) -> dict[str, Any]:
    out: dict[str, Any] = {
        "phase": shape.phase,
        "batch": shape.batch,
        "seq": shape.seq,
        "count": shape.count,
        "first_step": shape.first_step,
    }
    if not shape.certain:
        out["certain"] = False
    for name in _OPTIONAL:
        value = getattr(shape, name)
        if value != _DEFAULTS[name]:
            out[name] = [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value
    return out


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    stats = plan.stats
    return {
        "schema": PLAN_SCHEMA,
        "method": plan.method,
        **({"observed": True} if plan.observed else {}),
        "exact": plan.exact,
        "pad_to_multiple_of": plan.pad_to_multiple_of,
        "versions": dict(sorted(plan.versions.items())),
        "config": dict(sorted(plan.config.items())),
        "fingerprint": dict(sorted(plan.fingerprint.items())),
        "stats": {
            "rows": stats.rows,
            "dropped_rows": stats.dropped_rows,
            "micro_batches": stats.micro_batches,
            "optimizer_steps": stats.optimizer_steps,
            "tokens": stats.tokens,
            "padded_tokens": stats.padded_tokens,
            "evaluations": stats.evaluations,
            "eval_rows": stats.eval_rows,
            "padding_waste": round(stats.padding_waste, 6),
        },
        "shapes": [shape_to_dict(s) for s in plan.shapes],
        "warnings": list(plan.warnings),
    }


def plan_from_dict(data: dict[str, Any]) -> Plan:
    if not isinstance(data, dict) or data.get("schema") != PLAN_SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise PlanFileError(f"not a shapeplan plan (schema {found!r}, expected {PLAN_SCHEMA}); "
                            "write one with `shapeplan analyze ... -o PLAN`")
    try:
        shapes = tuple(
            Shape(
                phase=s["phase"],
                batch=int(s["batch"]),
                seq=int(s["seq"]),
                count=int(s["count"]),
                first_step=int(s["first_step"]),
                certain=bool(s.get("certain", True)),
                cache_len=s.get("cache_len"),
                max_new_tokens=s.get("max_new_tokens"),
                logits_to_keep=s.get("logits_to_keep"),
                cu_seq_lens=tuple(s.get("cu_seq_lens", ())),
                max_length_q=tuple(s.get("max_length_q", ())),
                varlen_pairs=tuple((int(c), int(q)) for c, q in s.get("varlen_pairs", ())),
                unpadded=int(s.get("unpadded", 0)),
                completion_tokens=tuple(s.get("completion_tokens", ())),
                chosen_rows=tuple(s.get("chosen_rows", ())),
            )
            for s in data["shapes"]
        )
        st = data["stats"]
        stats = PlanStats(rows=st["rows"], dropped_rows=st["dropped_rows"], micro_batches=st["micro_batches"],
                          optimizer_steps=st["optimizer_steps"], tokens=st["tokens"],
                          padded_tokens=st["padded_tokens"], evaluations=int(st.get("evaluations", 0)),
                          eval_rows=int(st.get("eval_rows", 0)))
        return Plan(
            method=data["method"],
            exact=bool(data["exact"]),
            pad_to_multiple_of=data["pad_to_multiple_of"],
            shapes=shapes,
            stats=stats,
            config=dict(data.get("config", {})),
            versions=dict(data.get("versions", {})),
            fingerprint=dict(data.get("fingerprint", {})),
            warnings=tuple(data.get("warnings", ())),
            observed=bool(data.get("observed", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanFileError(f"malformed plan: {exc!r} is missing or invalid; re-create it with `shapeplan analyze`") \
            from exc


def dumps(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), indent=2) + "\n"


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a partial one."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    try:
        write_atomic(path, dumps(plan))
    except OSError as exc:
        raise PlanFileError(f"cannot write plan to {path}: {exc.strerror}; choose a writable path with -o") from exc


def load_plan(path: str | os.PathLike[str]) -> Plan:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanFileError(f"cannot read plan {path}: {exc.strerror}; pass a file written by "
                            "`shapeplan analyze -o`") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFileError(f"plan {path} is not valid JSON (line {exc.lineno}); re-create it with "
                            "`shapeplan analyze -o`") from exc
    return plan_from_dict(data)
