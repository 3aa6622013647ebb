"""A cache of prepared row lengths, so re-planning an unchanged dataset, tokenizer and config skips tokenization.

One file per key under `$SHAPEPLAN_CACHE_DIR/lengths` (default `~/.cache/shapeplan/lengths`). The key holds the
dataset's fingerprint, the tokenizer's (vocabulary, normalization, special tokens, chat template), every option
that changes a prepared row's length, and the versions of the code that prepares rows. Files are written to a
temporary name and renamed, so a reader sees a whole file or none; one that fails to read, or whose stored key
differs, counts as a miss and is rewritten.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..plan.rows import Rows
from .data import tokenizer_fingerprint
from .host import cache_root, installed_versions

logger = logging.getLogger(__name__)

SCHEMA = 1
# SFTConfig fields that change which rows `_prepare_dataset` keeps, their lengths or their order.
LENGTH_OPTIONS = (
    "dataset_text_field", "eos_token", "assistant_only_loss", "completion_only_loss", "max_length",
    "truncation_mode", "packing_strategy", "shuffle_dataset", "seed", "dataset_num_proc", "dataset_kwargs",
)
_CODE = ("shapeplan", "trl", "transformers", "tokenizers", "datasets", "jinja2", "pyarrow")


def cache_dir() -> Path:
    return cache_root() / "lengths"


def length_key(dataset: Any, tokenizer: Any, config: Any, *, packing: bool) -> str | None:
    """The cache key of `prepare_rows(dataset, tokenizer, config, packing=packing)`; None if it has none."""
    fingerprint = getattr(dataset, "_fingerprint", None)
    if fingerprint is None:  # an IterableDataset: nothing identifies its content
        return None
    parts = {
        "schema": SCHEMA,
        "dataset": fingerprint,
        "rows": len(dataset),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "tokenizer_class": type(tokenizer).__name__,
        "split_special_tokens": getattr(tokenizer, "split_special_tokens", None),
        "packing": packing,
        "options": {name: getattr(config, name, None) for name in LENGTH_OPTIONS},
        "versions": installed_versions(_CODE),
    }
    return json.dumps(parts, sort_keys=True, default=str)


def load(key: str) -> tuple[Rows, int] | None:
    path = _path(key)
    try:
        with np.load(path, allow_pickle=False) as data:
            if str(data["key"]) != key:
                return None
            lengths = tuple(data["lengths"].tolist())
            documents = None
            if "document_offsets" in data:
                flat = data["documents"].tolist()
                offsets = data["document_offsets"].tolist()
                documents = tuple(tuple(flat[a:b]) for a, b in itertools.pairwise(offsets))
            dropped = int(data["dropped"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        logger.warning("ignoring unreadable length cache file %s (%s); recomputing", path, exc)
        return None
    return Rows(lengths=lengths, documents=documents), dropped


def store(key: str, rows: Rows, dropped: int) -> None:
    """Write atomically; a cache that cannot be written only costs the next run its speed."""
    path = _path(key)
    arrays: dict[str, Any] = {
        "key": np.array(key),
        "lengths": np.asarray(rows.lengths, dtype=np.int32),
        "dropped": np.array(dropped, dtype=np.int64),
    }
    if rows.documents is not None:
        arrays["documents"] = np.asarray([d for row in rows.documents for d in row], dtype=np.int32)
        arrays["document_offsets"] = np.concatenate([[0], np.cumsum([len(row) for row in rows.documents])])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", suffix=".npz", delete=False) as f:
            tmp = Path(f.name)
            try:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("cannot write the length cache in %s (%s); set SHAPEPLAN_CACHE_DIR to a writable folder",
                       path.parent, exc.strerror or exc)


def _path(key: str) -> Path:
    return cache_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz"

