"""Prepared SFT row lengths at tokenization speed, exactly as `SFTTrainer._prepare_dataset` would leave them.

TRL's preparation tokenizes row by row through six `Dataset.map` passes and writes every token id to Arrow. A plan
needs only the lengths, so this module renders each row with the same `apply_chat_template` call TRL makes,
tokenizes in large batches (rows spread over worker processes), and keeps one integer per row. The rules that
follow tokenization (EOS added to plain text, completion masks, `max_length` truncation and the drop of rows left
with no trainable token, shuffling, packing) are TRL's, applied to lengths:

- truncation keeps `range(length)[slice]`, the slice TRL cuts with;
- a completion-only loss keeps a row when a trainable token (position >= prompt_len) is in the kept window. An
  upper bound of prompt_len decides most rows without tokenizing the prompt (`_lengths_and_prompt_bounds`); the
  few rows the bound cannot decide go through TRL's own `_prepare_dataset` (`_trl_decides`);
- shuffling and packing run TRL's and datasets' own code on a dataset whose lists hold no values, only lengths.

What this cannot follow row by row (assistant-only loss masks, from/value conversations, datasets already
tokenized or formatted, iterable datasets, vision data) is left to TRL's path: see `fast_path_refusal`.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..plan.rows import Rows
from .host import usable_cores, workers_setting

_ROW_INDEX = "__shapeplan_row"
CHUNK_ROWS = 1024  # rows rendered and tokenized together; bounds memory to one chunk of token ids per worker


@dataclass(frozen=True)
class _Job:
    """What a worker needs to turn rows into lengths (inherited through fork, never pickled)."""

    dataset: Any
    tokenizer: Any
    kind: str  # "messages", "prompt-completion" or "text"
    conversational: bool  # prompt-completion rows hold messages (rendered with the chat template)
    text_field: str
    eos_token: str
    chat_template: str | None
    need_prompt_lengths: bool
    window: slice | None  # the truncation slice, None when rows are not truncated
    eos_counting: tuple[int, int] | None  # see `_countable_eos`


_JOB: _Job | None = None
# Token counts per (dataset, tokenizer, rendering) inside `shared_tokenization()`: plans that differ only in
# max_length, truncation or packing (`shapeplan advise`'s alternatives) re-derive their rows from one tokenization.
_TOKENIZED: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] | None = None


def fast_path_refusal(dataset: Any, tokenizer: Any, config: Any) -> str | None:
    """Why the fast path cannot guarantee TRL's lengths for this dataset, or None when it can."""
    import datasets

    # a processor is an instance of a class in transformers.processing_utils: none exists before that module loads
    # (importing it imports transformers' modelling code, seconds)
    processing = sys.modules.get("transformers.processing_utils")
    if not isinstance(dataset, datasets.Dataset):
        return "iterable dataset"
    if dataset.format["type"] is not None:
        return f"dataset formatted as {dataset.format['type']!r}"
    if "input_ids" in dataset.column_names:
        return "dataset already tokenized"
    if (processing is not None and isinstance(tokenizer, processing.ProcessorMixin)) or \
            {"image", "images"} & set(dataset.column_names):
        return "vision data"
    if config.assistant_only_loss:
        return "assistant_only_loss masks"
    if is_conversational_from_value(dataset[0]):
        return "from/value conversations"
    return None


def fast_prepared_rows(trainer: Any, dataset: Any, tokenizer: Any, config: Any, *, packing: bool, name: str,
                       workers: int | None = None) -> tuple[Rows, int]:
    """The rows `trainer._prepare_dataset(dataset, ...)` would produce, as lengths; and how many rows it drops.

    `trainer` is the bare `SFTTrainer` whose `chat_template`, `completion_only_loss` and tokenizer EOS TRL's
    preparation reads. Only for datasets `fast_path_refusal` accepts.
    """
    first = dataset[0]
    kind = "prompt-completion" if "prompt" in first else "messages" if is_conversational(first) else "text"
    masked = trainer.completion_only_loss and kind == "prompt-completion"
    truncating = config.max_length is not None and not packing
    read = {"messages", "prompt", "completion", "tools", "chat_template_kwargs", config.dataset_text_field}
    job = _Job(
        dataset=dataset.select_columns([c for c in dataset.column_names if c in read]),
        tokenizer=tokenizer,
        kind=kind,
        conversational=is_conversational(first),
        text_field=config.dataset_text_field,
        eos_token=trainer._tokenizer.eos_token,
        chat_template=trainer.chat_template,
        need_prompt_lengths=masked and truncating,
        window=_truncation_slice(config) if truncating else None,
        eos_counting=_countable_eos(tokenizer, trainer._tokenizer.eos_token, special=not is_conversational(first)),
    )
    lengths, prompt_bounds = _memo_token_lengths(job, workers=_workers(workers, len(dataset)))

    kept = np.ones(len(lengths), dtype=bool)
    if job.window is not None:
        starts, stops = _windows(lengths, job.window)
        if masked:
            # A completion mask trains on positions >= prompt_len; `prompt_bounds` bound prompt_len from above. A
            # row whose bound ends inside its kept window surely keeps a trainable token; the others TRL decides.
            doubt = np.flatnonzero(prompt_bounds >= stops)
            kept &= stops > starts
            if len(doubt):
                kept[doubt] = _trl_decides(trainer, dataset, config, doubt, name)
        else:
            kept &= stops > starts  # labels == input_ids: any kept token trains
        lengths = stops - starts
    lengths = lengths[kept]
    dropped = 0 if packing else int(len(kept) - kept.sum())
    return _shuffled_and_packed(lengths, config, packing=packing), dropped


# TRL's row-format checks (trl/data_utils.py), as TRL words them: its module imports transformers' processors, which
# import transformers' modelling code (seconds before the first row). tests/adapters/test_lengths.py holds them to
# TRL's.
def is_conversational(example: dict[str, Any]) -> bool:
    """TRL's `is_conversational`: the first supported key holds a list whose first item is a message with a role."""
    keys = {key for key in example if key in ("prompt", "chosen", "rejected", "completion", "messages")}
    if keys:
        messages = example[keys.pop()]
        if isinstance(messages, list):
            message = messages[0]
            if isinstance(message, dict) and "role" in message:
                return True
    return False


def is_conversational_from_value(example: dict[str, Any]) -> bool:
    """TRL's `is_conversational_from_value`: `conversations` holds from/value messages."""
    messages = example.get("conversations")
    if isinstance(messages, list):
        message = messages[0]
        if isinstance(message, dict) and "from" in message and "value" in message:
            return True
    return False


def _workers(requested: int | None, rows: int) -> int:
    if requested is not None:
        return max(1, requested)
    setting = workers_setting()
    if setting is not None:
        return setting
    cores = usable_cores()
    if cores <= 2:
        # Measured on 2 cores (benchmarks/analyze_speed.py --workers): one process, with the fast tokenizer's own
        # batch parallelism, beat two forked workers in time and CPU (these pay copy-on-write faults). With more
        # cores the single-threaded rendering dominates one process, and workers spread it.
        return 1
    return max(1, min(cores, rows // (4 * CHUNK_ROWS)))  # forking costs more than it saves on a few chunks


@contextmanager
def shared_tokenization() -> Iterator[None]:
    """Within the block, each dataset and rendering is tokenized once, whatever max_length, truncation and packing
    the plans made in it use."""
    global _TOKENIZED
    _TOKENIZED = {}
    try:
        yield
    finally:
        _TOKENIZED = None


def _memo_token_lengths(job: _Job, *, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """`_token_lengths`, once per dataset and rendering inside `shared_tokenization()`. The truncation window is
    part of the key only where the prompt bounds depend on it."""
    from .data import tokenizer_fingerprint

    fingerprint = getattr(job.dataset, "_fingerprint", None)
    if _TOKENIZED is None or fingerprint is None:
        return _token_lengths(job, workers=workers)
    key = (fingerprint, len(job.dataset), tokenizer_fingerprint(job.tokenizer), job.kind, job.conversational,
           job.text_field, job.eos_token, job.chat_template, job.need_prompt_lengths,
           repr(job.window) if job.need_prompt_lengths else None, job.eos_counting)
    if key not in _TOKENIZED:
        _TOKENIZED[key] = _token_lengths(job, workers=workers)
    return _TOKENIZED[key]


def _token_lengths(job: _Job, *, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """(token count, upper bound of the completion mask's prompt_len or -1) of every row, in dataset order."""
    global _JOB
    n = len(job.dataset)
    chunks = [(start, min(start + CHUNK_ROWS, n)) for start in range(0, n, CHUNK_ROWS)]
    _JOB = job
    try:
        if workers == 1:
            parts = _threaded(chunks)
        else:
            import multiprocessing

            # fork: the workers inherit the dataset (memory-mapped) and the tokenizer instead of pickling them.
            with multiprocessing.get_context("fork").Pool(workers, initializer=_worker_init) as pool:
                parts = pool.map(_chunk_lengths, chunks, chunksize=1)
    finally:
        _JOB = None
    if not parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lengths = np.concatenate([p[0] for p in parts]).astype(np.int64)
    prompts = np.concatenate([p[1] for p in parts]).astype(np.int64)
    return lengths, prompts


def _threaded(chunks: list[tuple[int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """`_chunk_lengths` of every chunk in one process: this thread renders the chunks' chat templates one after
    another (Python, under the GIL) while two threads tokenize the chunks rendered before (the Rust tokenizer releases
    the GIL; one core each, its own thread pool off: a pool used before a fork makes the tokenizer warn in the
    child). Measured on 2 cores, 30,000 conversations (after loading): 4.0 s, against 4.7 s with two threads each
    rendering and tokenizing its chunks (one idles while both render) and 5.5 s rendering, then tokenizing with the
    tokenizer's own pool, chunk after chunk."""
    from collections import deque
    from concurrent.futures import Future, ThreadPoolExecutor

    job = _JOB
    assert job is not None
    if len(chunks) < 2:
        return [_chunk_lengths(chunk) for chunk in chunks]
    tokenizer = job.tokenizer
    if _is_backend(tokenizer):
        _prepare_backend(tokenizer)  # once, before the threads: it may change the Rust tokenizer's state
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by the Rust tokenizer at each batch
    try:
        parts = []
        with ThreadPoolExecutor(2, thread_name_prefix="shapeplan-lengths") as pool:
            counting: deque[Future[tuple[np.ndarray, np.ndarray]]] = deque()
            for chunk in chunks:
                counting.append(pool.submit(_counted, job, _texts(job, chunk)))
                if len(counting) > 2:  # two chunks rendered ahead at most: memory stays a few chunks' texts
                    parts.append(counting.popleft().result())
            parts += [future.result() for future in counting]
        return parts
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _worker_init() -> None:
    # Each worker is one core; the Rust tokenizer's own thread pool would only contend with the other workers.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _chunk_lengths(chunk: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    job = _JOB
    assert job is not None
    return _counted(job, _texts(job, chunk))


@dataclass(frozen=True)
class _Texts:
    """A chunk's rows as TRL tokenizes them: each row's full text and, where prompt lengths are needed, its prompt."""

    full: list[str]
    special: bool  # tokenized with the tokenizer's special tokens (plain text)
    prompts: list[str] | None


def _texts(job: _Job, chunk: tuple[int, int]) -> _Texts:
    start, stop = chunk
    columns = job.dataset[start:stop]
    rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    if job.kind == "messages":
        return _Texts(_rendered(job, [row["messages"] for row in rows], rows), special=False, prompts=None)
    if job.kind == "text":
        return _Texts([_with_eos(row[job.text_field], job.eos_token) for row in rows], special=True, prompts=None)
    if job.conversational:
        full = _rendered(job, [row["prompt"] + row["completion"] for row in rows], rows)
    else:
        full = [row["prompt"] + _completion_with_eos(row, job) for row in rows]
    special = not job.conversational  # TRL tokenizes plain text with the tokenizer's special tokens
    if not job.need_prompt_lengths:
        return _Texts(full, special=special, prompts=None)
    if job.conversational:
        prompts = _rendered(job, [row["prompt"] for row in rows], rows, add_generation_prompt=True)
    else:
        prompts = [row["prompt"] for row in rows]
    return _Texts(full, special=special, prompts=prompts)


def _counted(job: _Job, texts: _Texts) -> tuple[np.ndarray, np.ndarray]:
    """(token count, upper bound of the completion mask's prompt_len or -1) of each of a chunk's rows."""
    if texts.prompts is None:
        return (_encode_lengths(job.tokenizer, texts.full, special=texts.special),
                np.full(len(texts.full), -1, dtype=np.int32))
    return _lengths_and_prompt_bounds(job, texts.full, texts.prompts, special=texts.special)


def _lengths_and_prompt_bounds(job: _Job, full: list[str], prompts: list[str], *,
                               special: bool) -> tuple[np.ndarray, np.ndarray]:
    """Token counts of `full`, and for each row an upper bound of TRL's prompt_len (the common prefix of the prompt's
    ids and the full ids): len(prompt ids), or L - 1 where the full ids hold more EOS ids than the prompt's can.

    If prompt_len were L, the full ids would be a prefix of the prompt's and hold no more EOS ids than they do. The
    count bound saves tokenizing prompts whenever the kept window reaches the row's last token (most rows).
    """
    assert job.window is not None
    if job.eos_counting is None:
        return _encode_lengths(job.tokenizer, full, special=special), _encode_lengths(job.tokenizer, prompts,
                                                                                     special=special)
    eos_id, added = job.eos_counting
    eos = job.eos_token
    encodings = _encodings(job.tokenizer, full, special=special)
    lengths = np.fromiter((len(e) for e in encodings), dtype=np.int32, count=len(full))
    bounds = np.empty(len(full), dtype=np.int32)
    pending = []
    for i, (encoding, prompt) in enumerate(zip(encodings, prompts, strict=True)):
        length = int(lengths[i])
        kept = range(length)[job.window]
        if kept.stop == length and encoding.ids.count(eos_id) > prompt.count(eos) + added:
            bounds[i] = length - 1
        else:
            pending.append(i)
    bounds[pending] = _encode_lengths(job.tokenizer, [prompts[i] for i in pending], special=special)
    return lengths, bounds


def _rendered(job: _Job, conversations: list[list[dict[str, Any]]], rows: list[dict[str, Any]],
              **kwargs: Any) -> list[str]:
    """`_render` of each row: in one `apply_chat_template` call where no row has arguments of its own (tools, chat
    template kwargs), which renders each conversation as its own call would, without the per-call set-up."""
    if any(row.get("tools") or row.get("chat_template_kwargs") for row in rows):
        return [_render(job, conversation, row, **kwargs) for conversation, row in zip(conversations, rows,
                                                                                     strict=True)]
    return list(job.tokenizer.apply_chat_template(conversations, tokenize=False, chat_template=job.chat_template,
                                                  **kwargs))


def _render(job: _Job, messages: list[dict[str, Any]], row: dict[str, Any], **kwargs: Any) -> str:
    """The text `_tokenize` renders before tokenizing it (`SFTTrainer.tokenize_fn`'s chat template arguments)."""
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    return job.tokenizer.apply_chat_template(
        messages, tokenize=False, chat_template=job.chat_template, tools=tools,
        **kwargs, **row.get("chat_template_kwargs", {}),
    )


def _with_eos(text: str, eos: str) -> str:
    return text if text.endswith(eos) else text + eos


def _completion_with_eos(row: dict[str, Any], job: _Job) -> str:
    # TRL's `add_eos` adds EOS to the text column when a row has one, and to the completion only otherwise.
    completion: str = row["completion"]
    if job.text_field in row:
        return completion
    return _with_eos(completion, job.eos_token)


def _encode_lengths(tokenizer: Any, texts: list[str], *, special: bool) -> np.ndarray:
    """`len(tokenizer(text, add_special_tokens=special)["input_ids"])` for each text, in one batch."""
    if not texts:
        return np.zeros(0, dtype=np.int32)
    if _is_backend(tokenizer):
        encodings = _encodings(tokenizer, texts, special=special)
        return np.fromiter((len(e) for e in encodings), dtype=np.int32, count=len(texts))
    ids = tokenizer(texts, add_special_tokens=special)["input_ids"]
    return np.fromiter((len(i) for i in ids), dtype=np.int32, count=len(texts))


def _is_backend(tokenizer: Any) -> bool:
    from transformers import TokenizersBackend

    return type(tokenizer)._encode_plus is TokenizersBackend._encode_plus


def _encodings(tokenizer: Any, texts: list[str], *, special: bool) -> list[Any]:
    """The Rust encodings `TokenizersBackend._encode_plus` makes, without converting every id to a Python int: the
    same backend state (no truncation, no padding, split_special_tokens) and the same ids, from `encode_batch_fast`
    (`encode_batch` without character offsets, which lengths do not need)."""
    return _prepare_backend(tokenizer).encode_batch_fast(texts, add_special_tokens=special)


def _prepare_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer, in the state `TokenizersBackend._encode_plus` puts it in (no truncation, no padding,
    split_special_tokens); changed only where it differs, so that a thread's batch is never changed under it."""
    from transformers.tokenization_utils_base import PaddingStrategy, TruncationStrategy

    tokenizer.set_truncation_and_padding(
        padding_strategy=PaddingStrategy.DO_NOT_PAD, truncation_strategy=TruncationStrategy.DO_NOT_TRUNCATE,
        max_length=None, stride=0, pad_to_multiple_of=None, padding_side=None,
    )
    backend = tokenizer._tokenizer
    if backend.encode_special_tokens != tokenizer.split_special_tokens:
        backend.encode_special_tokens = tokenizer.split_special_tokens
    return backend


def _countable_eos(tokenizer: Any, eos: str, *, special: bool) -> tuple[int, int] | None:
    """(EOS's id, EOS ids the post-processor adds) when a tokenization of a text holds at most as many EOS ids as
    the text holds EOS's text, plus those the post-processor adds; None when that is not sure.

    It holds when EOS is an added token matched in the raw text (or in text no normalizer changes), since matches
    of one pattern cannot outnumber its non-overlapping occurrences, and the model cannot make EOS's id from other
    text: EOS is not in the model's vocabulary, or is a BPE entry of several characters that no merge produces.
    """
    if not _is_backend(tokenizer):
        return None
    backend = tokenizer._tokenizer
    token = next((t for t in backend.get_added_tokens_decoder().values() if t.content == eos), None)
    if token is None or (token.normalized and backend.normalizer is not None):
        return None
    eos_id = backend.token_to_id(eos)
    model_keys = {key for key, i in backend.get_vocab(with_added_tokens=False).items() if i == eos_id}
    if model_keys:
        model = json.loads(backend.to_str())["model"]
        if model.get("type") != "BPE" or model.get("unk_token") in model_keys:
            return None
        merged = {a + b for a, b in (m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"])}
        if any(len(key) == 1 or key in merged for key in model_keys):
            return None
    added = backend.encode("", add_special_tokens=special).ids.count(eos_id)
    return eos_id, added


def _truncation_slice(config: Any) -> slice:
    if config.truncation_mode == "keep_start":
        return slice(None, config.max_length)
    if config.truncation_mode == "keep_end":
        return slice(-config.max_length, None)
    raise ValueError(f"Unsupported truncation mode: {config.truncation_mode}, expected 'keep_start' or 'keep_end'")


def _windows(lengths: np.ndarray, window: slice) -> tuple[np.ndarray, np.ndarray]:
    """[start, stop) of the tokens `ids[window]` keeps, per row: Python's slice rules on each distinct length."""
    distinct, inverse = np.unique(lengths, return_inverse=True)
    kept = [range(int(n))[window] for n in distinct]
    bounds = np.array([(r.start, max(r.stop, r.start)) for r in kept], dtype=np.int64).reshape(-1, 2)
    return bounds[inverse, 0], bounds[inverse, 1]


def _trl_decides(trainer: Any, dataset: Any, config: Any, rows: np.ndarray, name: str) -> np.ndarray:
    """Whether TRL's own preparation keeps each of `rows` (its truncation and drop of untrainable rows)."""
    indices = [int(i) for i in rows]
    subset = dataset.select(indices).add_column(_ROW_INDEX, indices)
    unshuffled = copy.copy(config)
    unshuffled.shuffle_dataset = False
    prepared = trainer._prepare_dataset(subset, trainer._tokenizer, unshuffled, False, None,
                                        f"{name} (rows near max_length)")
    survivors = set(prepared[_ROW_INDEX])
    return np.fromiter((i in survivors for i in indices), dtype=bool, count=len(indices))


def _shuffled_and_packed(lengths: np.ndarray, config: Any, *, packing: bool) -> Rows:
    """TRL's shuffle and `pack_dataset` on a dataset of value-less lists, one per prepared row."""
    if not packing and not config.shuffle_dataset:
        return Rows(lengths=tuple(int(x) for x in lengths))
    import datasets
    import pyarrow as pa
    from trl.data_utils import pack_dataset

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # list<null> has no value buffer: the lists have their lengths and hold no memory.
    ids = pa.LargeListArray.from_arrays(pa.array(offsets), pa.nulls(int(offsets[-1])))
    dataset = datasets.Dataset(pa.table({"input_ids": ids}))
    map_kwargs = {"num_proc": config.dataset_num_proc}
    if packing:
        if config.shuffle_dataset:
            dataset = dataset.shuffle(seed=config.seed)
        dataset = pack_dataset(dataset, config.max_length, config.packing_strategy, map_kwargs)
    if config.shuffle_dataset:
        dataset = dataset.shuffle(seed=config.seed)
    return dataset_rows(dataset)


def dataset_rows(dataset: Any) -> Rows:
    """The token lengths of a prepared dataset's rows (and, for packed rows, of their documents)."""
    import pyarrow.compute as pc

    # Through the arrow formatter, so the indices mapping that `filter` and `shuffle` leave is honoured.
    columns = ["input_ids", "seq_lengths"] if "seq_lengths" in dataset.column_names else ["input_ids"]
    table = dataset.select_columns(columns).with_format("arrow")[:]
    lengths = tuple(pc.list_value_length(table.column("input_ids")).to_pylist())
    documents = None
    if "seq_lengths" in columns:
        documents = tuple(tuple(d) for d in table.column("seq_lengths").to_pylist())
    return Rows(lengths=lengths, documents=documents)

