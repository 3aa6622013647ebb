"""Refusals that need no TRL: read from the run's words before TRL, transformers or datasets is imported (seconds
of imports), with the same one line the loading would give after them.

Only what is certain is refused here: a `--config` file that cannot be read, a local dataset path or model folder
that does not exist, and a Hub id while the Hub cannot be used when the Hugging Face caches hold nothing under its
name. Anything else is left to the libraries.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import DatasetError, ModelError
from .config_file import read_config
from .data import missing_local_dataset, missing_model_folder
from .host import hub_offline, hub_unusable

_DATASET_OPTIONS = ("--dataset_name", "--dataset-name")
_MODEL_OPTIONS = ("--model", "--model_name_or_path", "--model-name-or-path")


def refuse_before_imports(words: Sequence[str], *, model: str | None = None, eval_source: str | None = None) -> None:
    """Refuse the run `words` (TRL's options and at most one leading bare DATASET) names, when it is sure to fail."""
    config: dict[str, object] = {}
    for path in _values(words, ("--config",)):
        config.update(read_config(path))  # an unreadable file: its one line
    datasets = list(_values(words, _DATASET_OPTIONS))
    if words and not words[0].startswith("-"):
        datasets.append(words[0])
    if not datasets and isinstance(config.get("dataset_name"), str) and not config.get("datasets"):
        datasets.append(str(config["dataset_name"]))
    for source in [*datasets, *([eval_source] if eval_source else [])]:
        missing = missing_local_dataset(source)
        if missing is not None:
            raise DatasetError(missing)
        if not Path(source).exists():
            _refuse_uncached_hub_id(source, "dataset")
    models = [model] if model else list(_values(words, _MODEL_OPTIONS))
    if not models and isinstance(config.get("model_name_or_path"), str):
        models.append(str(config["model_name_or_path"]))
    # the default model is not checked: with `warm --plan` the plan names the model
    for name in models:
        missing = missing_model_folder(name)
        if missing is not None:
            raise ModelError(missing)
        if not Path(name).expanduser().is_dir():
            _refuse_uncached_hub_id(name, "model")


def _values(words: Sequence[str], names: tuple[str, ...]) -> Iterator[str]:
    for i, word in enumerate(words):
        name, equals, inline = word.partition("=")
        if name in names:
            if equals:
                yield inline
            elif i + 1 < len(words):
                yield words[i + 1]


def _refuse_uncached_hub_id(name: str, kind: str) -> None:
    """Refuse Hub id `name` (a "dataset" or "model") while the Hub cannot be used and no cache holds anything under
    its name (the libraries would look there and fail)."""
    if _cached(name, kind) or hub_offline() is None:
        return
    reason = hub_unusable(name, kind)
    if reason is not None:
        raise (DatasetError if kind == "dataset" else ModelError)(reason)


def _cached(name: str, kind: str) -> bool:
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub")
    if (hub.expanduser() / f"{kind}s--{name.replace('/', '--')}").exists():
        return True
    if kind != "dataset":
        return False
    folder = Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets").expanduser()
    prefix = name.replace("/", "___").lower()
    try:
        return any(entry.name.lower().startswith(prefix) for entry in folder.iterdir())
    except OSError:  # no datasets cache
        return False
