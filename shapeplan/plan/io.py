"""The plan file: a JSON contract other tools read (documented in docs/plan-schema.md). The schema lives here only."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import PlanFileError
from .model import METHODS, PHASES, Plan, PlanStats, Shape
from .vision import FAMILIES
from .vision.family import ImageKey

PLAN_SCHEMA = 1

# Optional shape fields, written only when not their default.
_OPTIONAL = ("max_count", "cache_len", "max_new_tokens", "logits_to_keep", "cu_seq_lens", "max_length_q",
             "varlen_pairs", "unpadded", "completion_tokens", "chosen_rows", "pixel_values", "text_runs")
_DEFAULTS = {f.name: f.default for f in fields(Shape)}


def shape_to_dict(shape: Shape, config: dict[str, Any]) -> dict[str, Any]:
    """`shape` as the plan file holds it; `config`: its plan's (which names the image keys' field)."""
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
            out[name] = _listed(value)
    if shape.images:
        out[images_field(config)] = _listed(shape.images)
    if shape.vision_inputs:
        out["vision_inputs"] = {name: list(dims) for name, dims in shape.vision_inputs}
    return out


def _listed(value: Any) -> Any:
    """Tuples as JSON lists, however deep."""
    return [_listed(v) for v in value] if isinstance(value, tuple) else value


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
        "shapes": [shape_to_dict(s, plan.config) for s in plan.shapes],
        "warnings": list(plan.warnings),
    }


# Bounds no real run reaches; beyond them a value is a typo or an attack (a 10^9-token seq exhausts host memory).
MAX_SEQ = 1 << 24
MAX_BATCH = 1 << 20
_MAX_COUNT = 1 << 62


def _malformed(where: str, problem: str, value: Any = None) -> PlanFileError:
    return PlanFileError(f"malformed plan: {where} {problem}; re-create it with `shapeplan analyze -o PLAN`",
                         field=where, value=value)


def _int(value: Any, where: str, low: int, high: int = _MAX_COUNT) -> int:
    """A JSON integer (not a bool, float or string) in [low, high]."""
    if type(value) is not int:
        raise _malformed(where, f"must be an integer, not {type(value).__name__}", value)
    if not low <= value <= high:
        shown = value if abs(value) < 10 ** 30 else f"a {len(str(abs(value)))}-digit number"
        raise _malformed(where, f"is {shown}, outside {low}..{high}", value)
    return value


def _ints(value: Any, where: str, low: int, high: int = _MAX_COUNT) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _malformed(where, f"must be a list of integers, not {type(value).__name__}")
    return tuple(_int(v, f"{where}[{i}]", low, high) for i, v in enumerate(value))


def _optional_int(value: Any, where: str, low: int) -> int | None:
    return None if value is None else _int(value, where, low, MAX_SEQ)


def _typed(value: Any, kind: type, where: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _malformed(where, f"must be a {kind.__name__}, not {type(value).__name__}")
    return value


def _shape_from_dict(s: Any, where: str, multiple: int | None, field: str) -> Shape:
    _typed(s, dict, where)
    for name in ("phase", "batch", "seq", "count", "first_step"):
        if name not in s:
            raise _malformed(f"{where}.{name}", "is missing")
    phase = s["phase"]
    if phase not in PHASES:
        raise _malformed(f"{where}.phase", f"is {phase!r}, not one of {', '.join(PHASES)}")
    seq = _int(s["seq"], f"{where}.seq", 1, MAX_SEQ)
    if multiple is not None and seq % multiple:
        raise _malformed(f"{where}.seq", f"is {seq}, not a multiple of the plan's pad_to_multiple_of {multiple}", seq)
    pairs = s.get("varlen_pairs", [])
    if not isinstance(pairs, list) or not all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
        raise _malformed(f"{where}.varlen_pairs", "must be a list of [len(cu_seq_lens), max_length_q] pairs")
    pixels, images, others = _vision(s, where, field)
    cache_len = _optional_int(s.get("cache_len"), f"{where}.cache_len", 1)
    if cache_len is not None and cache_len < seq:  # a static cache holds the prompt it is filled with, at least
        raise _malformed(f"{where}.cache_len", f"is {cache_len}, below the shape's prompt length (seq) {seq}",
                         cache_len)
    return Shape(
        phase=phase,
        batch=_int(s["batch"], f"{where}.batch", 1, MAX_BATCH),
        seq=seq,
        count=_int(s["count"], f"{where}.count", 1),
        first_step=_int(s["first_step"], f"{where}.first_step", 0),
        certain=_typed(s.get("certain", True), bool, f"{where}.certain"),
        max_count=None if s.get("max_count") is None else _int(s["max_count"], f"{where}.max_count", s["count"]),
        cache_len=cache_len,
        max_new_tokens=_optional_int(s.get("max_new_tokens"), f"{where}.max_new_tokens", 1),
        logits_to_keep=_optional_int(s.get("logits_to_keep"), f"{where}.logits_to_keep", 0),
        cu_seq_lens=_ints(s.get("cu_seq_lens", []), f"{where}.cu_seq_lens", 2, MAX_SEQ),
        max_length_q=_ints(s.get("max_length_q", []), f"{where}.max_length_q", 1, MAX_SEQ),
        varlen_pairs=tuple((_int(c, f"{where}.varlen_pairs", 2, MAX_SEQ),
                            _int(q, f"{where}.varlen_pairs", 1, MAX_SEQ)) for c, q in pairs),
        unpadded=_int(s.get("unpadded", 0), f"{where}.unpadded", 0),
        completion_tokens=_ints(s.get("completion_tokens", []), f"{where}.completion_tokens", 0),
        chosen_rows=_ints(s.get("chosen_rows", []), f"{where}.chosen_rows", 0),
        pixel_values=pixels,
        images=images,
        vision_inputs=others,
        text_runs=_text_runs(s, where, images, seq),
    )


def _text_runs(s: dict[str, Any], where: str, images: tuple[ImageKey, ...],
               seq: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """A vision batch's layouts: each a list of `batch` rows, each row's text runs (one more than its images), the
    rows' images together as many as the shape has."""
    layouts = s.get("text_runs", [])
    where = f"{where}.text_runs"
    if not isinstance(layouts, list) or not all(
            isinstance(layout, list) and len(layout) == s["batch"] and all(isinstance(row, list) and row
                                                                           for row in layout) for layout in layouts):
        raise _malformed(where, "must be a list of layouts, each a list of the batch's rows' text runs")
    out = tuple(tuple(_ints(row, where, 0, seq) for row in layout) for layout in layouts)
    for layout in out:
        if sum(len(row) - 1 for row in layout) != len(images):
            raise _malformed(where, "has a layout whose rows hold another number of images than the shape")
    return out


def _vision(s: dict[str, Any], where: str, field: str) -> tuple[tuple[int, ...] | None, tuple[ImageKey, ...],
                                                                 tuple[tuple[str, tuple[int, ...]], ...]]:
    """A vision batch's `pixel_values` shape, its images' keys (`field`: their JSON name) and its other vision
    inputs: the first two both or neither; Qwen-VL's pixel_values [N, D] with N the patches its grids hold."""
    inputs = s.get("vision_inputs", {})
    if not isinstance(inputs, dict):
        raise _malformed(f"{where}.vision_inputs", "must be an object of tensor names and shapes")
    others = tuple((str(name), _ints(shape, f"{where}.vision_inputs.{name}", 1)) for name, shape in inputs.items())
    if "pixel_values" not in s and field not in s:
        return None, (), others
    value, keys = s.get("pixel_values"), s.get(field)
    if not (isinstance(value, list) and value):
        raise _malformed(f"{where}.pixel_values", f"must be the pixel tensor's shape where {field} is given")
    if not (isinstance(keys, list) and keys and all(isinstance(k, list) for k in keys)):
        raise _malformed(f"{where}.{field}", "must be a list of each image's key where pixel_values is given")
    images = tuple(_ints(key, f"{where}.{field}[{i}]", 0, MAX_SEQ) for i, key in enumerate(keys))
    pixels = _ints(value, f"{where}.pixel_values", 1, _MAX_COUNT)
    if field == "image_grid_thw":  # Qwen-VL's: pixel_values [N, D], N the patches its grids hold
        if len(pixels) != 2 or any(len(grid) != 3 or 0 in grid for grid in images):
            raise _malformed(f"{where}", "must have pixel_values [N, D] and image_grid_thw rows [t, h, w] of whole "
                                         "numbers of at least 1")
        if pixels[0] != sum(t * h * w for t, h, w in images):
            raise _malformed(f"{where}.pixel_values[0]", "is not the number of patches its image_grid_thw holds",
                             pixels[0])
    return pixels, images, others


def keys_tensor(config: dict[str, Any]) -> str | None:
    """The batch tensor that holds a plan's image keys, where its family has one (Qwen-VL's image_grid_thw; plans
    made before other families were planned record no family, and are Qwen-VL's)."""
    family = FAMILIES.get(str(config.get("vision_family", "qwen2_vl")))
    return family.KEYS_TENSOR if family is not None else None


def images_field(config: dict[str, Any]) -> str:
    """The JSON name of a plan's image keys: the batch tensor that holds them, else `images`."""
    return keys_tensor(config) or "images"


def plan_from_dict(data: Any) -> Plan:
    """The plan `data` describes, every field checked for type, sign and range."""
    if isinstance(data, dict) and "schema" not in data and {"method", "shapes", "config"} & data.keys():
        raise _malformed("schema", "is missing")  # a plan that lost a field, not another kind of file
    if not isinstance(data, dict) or data.get("schema") != PLAN_SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise PlanFileError(f"not a shapeplan plan (schema {found!r}, expected {PLAN_SCHEMA}); "
                            "write one with `shapeplan analyze ... -o PLAN`")
    for name in ("method", "exact", "pad_to_multiple_of", "stats", "shapes", "config"):
        if name not in data:
            raise _malformed(name, "is missing")
    config = _typed(data["config"], dict, "config")
    argv = config.get("argv", [])
    if not (isinstance(argv, list) and all(isinstance(word, str) for word in argv)):
        raise _malformed("config.argv", "must be a list of strings (the run's TRL options)", argv)
    if "pad_tool_turns" in config:  # read as a switch (the guard pads the run's tool turns): "yes" is no bool
        _typed(config["pad_tool_turns"], bool, "config.pad_tool_turns")
    pin = config.get("pin_cache")  # the cache length the guard pins the run's cache at
    if pin is not None and not 1 <= _typed(pin, int, "config.pin_cache") <= MAX_SEQ:
        raise _malformed("config.pin_cache", f"must be a cache length from 1 to {MAX_SEQ:,}")
    method = data["method"]
    if method not in METHODS:
        raise _malformed("method", f"is {method!r}, not one of {', '.join(METHODS)}")
    multiple = data["pad_to_multiple_of"]
    if multiple is not None:
        multiple = _int(multiple, "pad_to_multiple_of", 1, MAX_SEQ)
    shape_list = _typed(data["shapes"], list, "shapes")
    if not shape_list:
        raise _malformed("shapes", "is empty: a plan lists at least one shape")
    field = images_field(config)
    shapes = tuple(_shape_from_dict(s, f"shapes[{i}]", multiple, field) for i, s in enumerate(shape_list))
    seen: dict[tuple[Any, ...], int] = {}
    for i, shape in enumerate(shapes):
        if shape.key in seen:
            raise _malformed(f"shapes[{i}]", f"repeats shapes[{seen[shape.key]}] ({shape.phase} {shape.batch}x"
                             f"{shape.seq})")
        seen[shape.key] = i
    st = _typed(data["stats"], dict, "stats")
    for name in ("rows", "dropped_rows", "micro_batches", "optimizer_steps", "tokens", "padded_tokens"):
        if name not in st:
            raise _malformed(f"stats.{name}", "is missing")
    stats = PlanStats(**{name: _int(st[name], f"stats.{name}", 0) for name in (
        "rows", "dropped_rows", "micro_batches", "optimizer_steps", "tokens", "padded_tokens")},
        evaluations=_int(st.get("evaluations", 0), "stats.evaluations", 0),
        eval_rows=_int(st.get("eval_rows", 0), "stats.eval_rows", 0))
    warnings = _typed(data.get("warnings", []), list, "warnings")
    if not all(isinstance(w, str) for w in warnings):
        raise _malformed("warnings", "must be a list of strings")
    return Plan(
        method=method,
        exact=_typed(data["exact"], bool, "exact"),
        pad_to_multiple_of=multiple,
        shapes=shapes,
        stats=stats,
        config=dict(config),
        versions=dict(_typed(data.get("versions", {}), dict, "versions")),
        fingerprint=dict(_typed(data.get("fingerprint", {}), dict, "fingerprint")),
        warnings=tuple(warnings),
        observed=_typed(data.get("observed", False), bool, "observed"),
    )


def dumps(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), indent=2) + "\n"


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(directory: Path, prefix: str) -> None:
    """Remove what processes that died before cleaning up left in `directory`: entries named `prefix` + their pid
    + "." or "-" + anything (see `temp_file`), whose process is gone."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    for path in entries:
        match = re.match(r"(\d+)[.-]", path.name[len(prefix):]) if path.name.startswith(prefix) else None
        if match is None or _alive(int(match.group(1))):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()


class TooLarge(Exception):
    """`read_bounded` found more than its limit."""


def read_bounded(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of an input file, at most `limit` of them (TooLarge past it: /dev/zero, or a link to it, ends
    there). A FIFO nobody writes reads as empty instead of blocking: it is opened without waiting for a writer,
    then read as usual (a pipe of `<(...)` has its writer already)."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb", closefd=True) as handle:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(path)
    return data


def temp_file(target: Path) -> tuple[int, str]:
    """A new temporary file next to `target` (fd, path), to be renamed onto it: named after this process so that
    the next writer of `target` removes it if this process is killed first, and with the mode a plain open()
    gives (mkstemp's 0600 would keep a cache baked by root from the training user)."""
    directory = target.parent if str(target.parent) else Path(".")
    remove_stale(directory, f".{target.name}.")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=directory)
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, tmp


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a partial one."""
    target = Path(path)
    fd, tmp = temp_file(target)
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


MAX_PLAN_BYTES = 64 << 20  # a plan of 100,000 shapes is some 10 MiB


def load_plan(path: str | os.PathLike[str]) -> Plan:
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(21, "Is a directory")
        text = read_bounded(path, MAX_PLAN_BYTES).decode("utf-8")
    except TooLarge:
        raise PlanFileError(f"plan {path} is over {MAX_PLAN_BYTES >> 20} MiB, more than any plan holds; pass a file "
                            "written by `shapeplan analyze -o`") from None
    except OSError as exc:
        raise PlanFileError(f"cannot read plan {path}: {exc.strerror}; pass a file written by "
                            "`shapeplan analyze -o`") from exc
    except UnicodeDecodeError as exc:
        raise PlanFileError(f"plan {path} is not UTF-8 text (byte {exc.start}); re-create it with "
                            "`shapeplan analyze -o`") from exc
    try:
        data = strict_json(text)
    except json.JSONDecodeError as exc:
        raise PlanFileError(f"plan {path} is not valid JSON (line {exc.lineno}); re-create it with "
                            "`shapeplan analyze -o`") from exc
    except ValueError as exc:  # a duplicate key, NaN/Infinity, or an integer too long to convert
        raise PlanFileError(f"plan {path} is not valid plan JSON ({exc}); re-create it with "
                            "`shapeplan analyze -o`") from exc
    except RecursionError:
        raise PlanFileError(f"plan {path} nests values deeper than a plan does; re-create it with "
                            "`shapeplan analyze -o`") from None
    return plan_from_dict(data)


def strict_json(text: str) -> Any:
    """JSON as the standard defines it: ValueError on a duplicate key or NaN/Infinity (which Python accepts)."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = value
        return out

    return json.loads(text, parse_constant=constant, object_pairs_hook=unique)
