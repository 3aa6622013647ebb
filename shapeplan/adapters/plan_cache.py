"""Whole plans cached by the command line that made them, so an unchanged re-run answers before any heavy import.

Importing TRL, transformers and datasets alone takes several seconds; the length cache cannot help with that. The
key here is everything a plan is made from that can be read without those imports: the command line, the working
directory, the size and modification time of every local file or folder it names (also inside a `--config` YAML
file), the accelerate default config, the HF/TRL/accelerate/shapeplan environment variables, and the installed
versions. A run that names a Hub id (`org/name`) or leaves the model to its Hub default is not cached: only the
Hub knows whether those changed. Files are written whole (temp name, then rename); anything unreadable is a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..plan.io import dumps, plan_from_dict, write_atomic
from ..plan.model import Plan
from .host import cache_root, installed_versions

logger = logging.getLogger(__name__)

SCHEMA = 2  # 2: vision SFT entries carry their rows' text_runs
_VERSIONED = ("shapeplan", "trl", "transformers", "accelerate", "datasets", "tokenizers", "torch", "jinja2")
_ENV_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TRL_", "ACCELERATE_", "SHAPEPLAN_")
_MAX_FILES = 10_000  # a folder with more files than this is not worth stat-ing on every run


def cache_dir() -> Path:
    return cache_root() / "plans"


def plan_key(method: str, words: Sequence[str]) -> str | None:
    """The key of the plan `shapeplan analyze --method METHOD WORDS...` makes, or None when it depends on something
    only the Hub can tell."""
    paths: dict[str, Any] = {}
    outputs = _output_paths(words)
    for word in _path_candidates(words):
        if word in outputs:  # what the run writes (checkpoints, logs) is not what planning reads
            continue
        signature = _signature(word, skip=tuple(outputs.values()))
        if signature is not None:
            paths[word] = signature
    if not _names_only_local(words, paths):
        return None
    versions = installed_versions(_VERSIONED)
    accelerate_default = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "accelerate"
    material = {
        "schema": SCHEMA,
        "method": method,
        "words": list(words),
        "cwd": os.getcwd(),
        "paths": paths,
        "accelerate_default": _signature(str(accelerate_default / "default_config.yaml")),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
        "versions": versions,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


def _path_candidates(words: Sequence[str]) -> Iterator[str]:
    for i, word in enumerate(words):
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        yield value
        if words[i - 1:i] == ["--config"] and i > 0:
            yield from _strings(_config(value))


def _config(path: str) -> dict[str, Any]:
    """The `--config` YAML file's mapping; empty when it is unreadable (TRL's parser will say why)."""
    from ..errors import UsageError
    from .config_file import read_config

    try:
        return read_config(path)  # bounded (alias expansion too: the key walks every string) and read once
    except UsageError:
        return {}


def _strings(item: Any) -> Iterator[str]:
    stack = [item]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _signature(path: str, *, skip: tuple[Path, ...] = ()) -> Any:
    """(size, mtime) of a file, or of every file below a folder but those under `skip`; None if `path` is no local
    path."""
    p = Path(path)
    try:
        if p.is_file():
            st = p.stat()
            return [st.st_size, st.st_mtime_ns]
        if p.is_dir():
            out = []
            files = (f for f in p.rglob("*") if f.is_file() and not any(f.resolve().is_relative_to(s) for s in skip))
            for n, file in enumerate(sorted(files)):
                if n >= _MAX_FILES:
                    return "too-many-files"
                st = file.stat()
                out.append([str(file.relative_to(p)), st.st_size, st.st_mtime_ns])
            return out
    except OSError:
        return None
    return None


_MODEL_OPTIONS = ("--model", "--model_name_or_path", "--model-name-or-path")
# where a run names what it writes, never a Hub id it reads
_OUTPUT_FIELDS = ("output_dir", "logging_dir", "run_name", "hub_model_id")
_WRITTEN_FOLDERS = ("output_dir", "logging_dir")  # folders training writes into


def _output_paths(words: Sequence[str]) -> dict[str, Path]:
    """The folders the run writes into (command line, else the `--config` file), each as given -> resolved."""
    out: dict[str, Path] = {}
    for i, word in enumerate(words):
        name, _, inline = word.partition("=")
        following = inline or (words[i + 1] if i + 1 < len(words) else "")
        given = [following] if name.startswith("--") and name[2:].replace("-", "_") in _WRITTEN_FOLDERS else []
        if name == "--config":
            config = _config(following)
            given += [v for k in _WRITTEN_FOLDERS if isinstance(v := config.get(k), str)]
        for value in given:
            if value:
                out[value] = Path(value).resolve()
    return out


def _names_only_local(words: Sequence[str], paths: dict[str, Any]) -> bool:
    """Whether the model is named (on the command line, else in the `--config` file) and local, and nothing the run
    reads names a Hub id (`org/name` that is no local path)."""
    model: str | None = None
    values: list[str] = []
    for i, word in enumerate(words):
        name, _, inline = word.partition("=")
        following = inline or (words[i + 1] if i + 1 < len(words) else "")
        if name in _MODEL_OPTIONS:
            model = following
        if name == "--config":
            config = _config(following)
            model = model or _text(config.get("model_name_or_path"))
            values += _strings({k: v for k, v in config.items() if k not in _OUTPUT_FIELDS})
        if name.startswith("--") and name[2:].replace("-", "_") in _OUTPUT_FIELDS and not inline:
            continue
        if i > 0 and words[i - 1].startswith("--") and words[i - 1][2:].replace("-", "_") in _OUTPUT_FIELDS:
            continue
        values.append(inline if word.startswith("-") else word)
    if any(_hub_id(value) and value not in paths for value in values):
        return False
    return model is not None and model in paths and all(v != "too-many-files" for v in paths.values())


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _hub_id(value: str) -> bool:
    """Whether `value` reads as a Hub id, `name` under an `org/` (one slash, a relative path's shape)."""
    org, slash, name = value.partition("/")
    return bool(slash and org and name) and "/" not in name and not org.startswith(".")


def load(key: str) -> Plan | None:
    try:
        return plan_from_dict(json.loads((cache_dir() / f"{key}.json").read_text(encoding="utf-8")))
    except Exception:  # a missing, torn or foreign file is a miss; the plan is recomputed and rewritten
        return None


def store(key: str, plan: Plan) -> None:
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / f"{key}.json", dumps(plan))
    except OSError as exc:  # an unwritable cache only costs speed
        logger.warning("cannot write the plan cache in %s: %s", directory, exc.strerror)
