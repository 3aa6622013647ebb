"""Loading datasets and tokenizers the way `trl <method>`'s `main()` does, plus local files."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from ..errors import DatasetError, ModelError, UsageError, first_line
from .host import hub_offline, hub_unusable
from .vision import image_columns

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_dataset_source(source: str, *, name: str | None = None, streaming: bool = False) -> Any:
    """A `DatasetDict` (or `Dataset`) from a Hub id, a local data file or a `save_to_disk` folder; with `streaming`,
    an `IterableDatasetDict` read lazily, as `load_dataset(..., streaming=True)` gives `trl <method>`."""
    import datasets

    path = Path(source)
    # datasets logs a parse failure before raising it; the error below carries the same cause in one line.
    datasets_logger = logging.getLogger("datasets")
    level = datasets_logger.level
    datasets_logger.setLevel(logging.CRITICAL)
    try:
        if path.is_file():
            builder = _FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DatasetError(f"dataset file {source} has an unsupported type {path.suffix!r}; "
                                   "use .jsonl, .json, .parquet or .csv")
            if _blank(path):  # datasets' own error for an empty file names no cause
                raise DatasetError(f"dataset {source} is empty; pass a dataset with at least one row")
            if builder == "json":
                check_nesting(path)
            if streaming:  # a stream reads the file as it goes: no Arrow cache to go stale
                return datasets.load_dataset(builder, data_files=str(path), streaming=True)
            # datasets reuses its Arrow cache of a file while path, size and mtime are unchanged; naming the config
            # after the content makes a file rewritten in place (same size and mtime) load its new rows
            with open(path, "rb") as handle:
                content = hashlib.file_digest(handle, "sha256").hexdigest()[:16]
            return datasets.load_dataset(builder, data_files=str(path), name=f"content-{content}")
        if path.is_dir():
            if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
                if streaming:
                    raise UsageError(f"dataset {source} is a save_to_disk folder, which `load_dataset(..., "
                                     "streaming=True)` does not read; stream a data file or a Hub id, or drop "
                                     "--dataset_streaming")
                return datasets.load_from_disk(str(path))
            for file in sorted(path.rglob("*.json*")):
                if file.suffix.lower() in (".json", ".jsonl") and file.is_file():
                    check_nesting(file)
            return datasets.load_dataset(str(path), name=name, streaming=streaming)
        missing = missing_local_dataset(source)
        if missing is not None:
            raise DatasetError(missing)
        hub_offline()  # an unreachable Hub: offline mode, so that datasets answers at once instead of retrying
        try:
            return datasets.load_dataset(source, name=name, streaming=streaming)
        except Exception as exc:
            offline = hub_unusable(source, "dataset")
            if offline is not None:
                raise DatasetError(offline) from exc
            raise
    except (DatasetError, UsageError):
        raise
    except FileNotFoundError as exc:
        raise DatasetError(f"dataset {source} not found ({first_line(exc)}); pass a local .jsonl/.json/.parquet/.csv "
                           "file, a save_to_disk folder, or a Hub id reachable from this machine") from exc
    except OSError as exc:
        raise DatasetError(f"cannot read dataset {source}: {exc.strerror or first_line(exc)}; check that the file "
                           "is readable") from exc
    except Exception as exc:  # datasets raises many types for unreadable data; report them as one line
        raise DatasetError(f"cannot read dataset {source}: {first_line(_root_cause(exc))}; check the file's format") \
            from exc
    finally:
        datasets_logger.setLevel(level)


def missing_local_dataset(source: str) -> str | None:
    """The one line for a dataset named as a local path (a path's shape or a data file's suffix) that does not
    exist, None otherwise."""
    path = Path(source)
    if path.exists():
        return None
    if source.count("/") > 1 or source.startswith((".", "/", "~")) or path.suffix.lower() in _FILE_BUILDERS:
        return f"dataset {source} not found: no such file or folder; pass an existing path or a Hub dataset id"
    return None


def missing_model_folder(model: str) -> str | None:
    """The one line for a model named as a local folder (`.`, `/` or `~` first) that does not exist."""
    if model.startswith((".", "/", "~")) and not Path(model).expanduser().is_dir():
        return f"model folder {model} not found; pass an existing model folder or a Hub id with --model"
    return None


def select_split(data: Any, split: str, source: str) -> Any:
    import datasets

    if isinstance(data, (datasets.Dataset, datasets.IterableDataset)):
        return data
    if split not in data:
        raise DatasetError(f"dataset {source} has no split {split!r} (it has {', '.join(data)}); "
                           "choose one with --dataset_train_split / --dataset_test_split")
    return data[split]


def check_rows(dataset: Any, source: str) -> None:
    import datasets

    # A stream has no length; reading its first row tells whether it has one.
    empty = next(iter(dataset), None) is None if isinstance(dataset, datasets.IterableDataset) else len(dataset) == 0
    if empty:
        raise DatasetError(f"dataset {source} is empty; pass a dataset with at least one row")


def check_text_only(dataset: Any, source: str, method: str) -> None:
    """Refuse vision-language data for a method whose planner does not count image tokens and pixel batches
    (planned as text, the plan would miss every shape); SFT's, GRPO's and RLOO's plan them (adapters/vision.py)."""
    images = image_columns(dataset)
    if images:
        raise UsageError(f"dataset {source} has an {images[0]!r} column: vision-language {method} runs are not "
                         "planned yet (their image tokens and pixel batches are not counted); shapeplan plans images "
                         "for SFT, GRPO and RLOO runs, and text-only datasets for the other methods")


def load_tokenizer(model: str | None, *, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    if not model:  # TRL's ModelConfig leaves it None when neither --model nor --model_name_or_path is given
        raise ModelError("no model is given; pass --model (TRL: --model_name_or_path)")
    missing = missing_model_folder(model)
    if missing is not None:
        raise ModelError(missing)
    folder = Path(model).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelError(f"model folder {model} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:2])}, ...); copy "
                         "them from the model's Hub repository into it, or pass the folder that has them with --model")
    if not folder.is_dir():
        hub_offline()  # an unreachable Hub: offline mode, so that transformers answers at once instead of retrying
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises OSError, ValueError, HF errors... for a bad model id
        offline = None if folder.is_dir() else hub_unusable(model, "model")
        if offline is not None:
            raise ModelError(offline) from exc
        if folder.is_dir():
            raise ModelError(f"model folder {model} is unusable: {first_line(exc)}; download it again or pass "
                             "another folder with --model") from exc
        raise ModelError(f"cannot load the tokenizer of {model}: {first_line(exc)}; pass a local model folder or a "
                         "Hub id reachable from this machine with --model") from exc
    template = getattr(tokenizer, "chat_template", None)
    if not (template is None or isinstance(template, str) or (
            isinstance(template, (list, dict)) and all(isinstance(t, (str, dict)) for t in template))):
        raise ModelError(f"the chat_template of {model}'s tokenizer is a {type(template).__name__}, not Jinja text; "
                         "fix it in its tokenizer_config.json (or chat_template.jinja)")
    return tokenizer


def check_weight_files(model: str | None) -> None:
    """Refuse a local model folder whose safetensors files are cut short (an interrupted download or copy): each
    holds an 8-byte header length, a JSON header and the tensors' bytes up to the header's last offset."""
    folder = Path(model or "").expanduser()
    if not model or not folder.is_dir():
        return
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with open(path, "rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(size)) if 0 < size <= 100 << 20 else None
        except (OSError, ValueError):
            header = None
        ends = [t["data_offsets"][1] for k, t in (header or {}).items()
                if k != "__metadata__" and isinstance(t, dict) and len(t.get("data_offsets", ())) == 2]
        if header is None or path.stat().st_size < 8 + size + max(ends, default=0):
            raise ModelError(f"model file {path} is truncated or not safetensors; download the model again or pass "
                             "another folder with --model")


# The files a tokenizer loads from (transformers' fast, slow and sentencepiece tokenizers).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of everything in the tokenizer that changes token counts (a processor's: its tokenizer's)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.chat_template, sort_keys=True, default=str).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


# Deeper than this, pyarrow's JSON reader stops ("object decoding depth limit") and the readers datasets falls back
# to crash the process (a 100,000-deep list: SIGSEGV, nothing on stderr), as they would in the real run. No
# training row nests more than a few levels.
MAX_NESTING = 1000


def check_nesting(path: Path) -> None:
    """Refuse a JSON/JSONL file that nests a value deeper than MAX_NESTING, naming the line, before any reader parses
    it: brackets outside strings, counted with numpy over chunks of whole lines."""
    import numpy as np

    # +1 for an opening bracket, -1 for a closing one, by byte value: one table lookup a byte (int8, then int32 sums
    # over a 16 MiB chunk: measured 5x faster than boolean masks of int64)
    steps = np.zeros(256, dtype=np.int8)
    steps[[ord("["), ord("{")]] = 1
    steps[[ord("]"), ord("}")]] = -1
    depth, inside, lines = 0, False, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24) + handle.readline():  # whole lines, to name the line
            text = chunk.replace(b"\\\\", b"").replace(b'\\"', b"")  # escaped backslashes, then escaped quotes
            data = np.frombuffer(text, dtype=np.uint8)
            quotes = np.cumsum(data == ord('"'), dtype=np.int32) + inside
            step = steps[data]
            step[(quotes & 1) == 1] = 0  # inside a string
            levels = np.cumsum(step, dtype=np.int32) + depth
            if len(levels) and levels.max() > MAX_NESTING:
                at = int(np.argmax(levels > MAX_NESTING))
                line = lines + text.count(b"\n", 0, at) + 1
                raise DatasetError(f"dataset {path} nests a value more than {MAX_NESTING} levels deep on line {line}: "
                                   "the JSON readers (and so the training run) crash on it; fix or drop that row")
            if len(levels):
                depth, inside = int(levels[-1]), bool(quotes[-1] % 2)
            lines += text.count(b"\n")


def _blank(path: Path) -> bool:
    """Whether the file holds only whitespace (reading it also checks that it is readable)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _root_cause(exc: BaseException) -> BaseException:
    """datasets wraps the parser's error (the useful line) in DatasetGenerationError."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc
