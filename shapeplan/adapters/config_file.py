"""A `--config` YAML file (and accelerate's config), read once and bounded before TRL sees it.

Read once: a pipe or process substitution (`--config <(...)`) yields its bytes only once, so every later reader
(the option scan, the launch options, the plan-cache key, TRL's own parser through `materialized`) gets the first
read's result. Bounded: the file's size, its nesting and the nodes its aliases expand to (a "billion laughs" file
is a few hundred bytes that expand to 10^9 strings for anything that walks it, as JSON does), and its decoding
(UTF-8, as TRL's `open()` reads it on Linux). Each failure is a UsageError naming the file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import UsageError
from ..plan.io import TooLarge, read_bounded

MAX_CONFIG_BYTES = 4 << 20  # a TRL config is a few KiB; a chat template inline is some more
MAX_DEPTH = 64
MAX_NODES = 100_000  # scalars, lists and mappings once aliases are expanded
# The fix of a file that is no TRL config.
_FLAT = "pass the run's config: a YAML mapping of TRL option names to values (`max_length: 1024`, one a line)"

# (path, and for a regular file its identity) -> (bytes, mapping) of this process's first read
_READ: dict[tuple[str, int, int, int], tuple[bytes, dict[str, Any]]] = {}


def read_config(path: str) -> dict[str, Any]:
    """The YAML mapping in `path` (a fresh copy: callers pop keys)."""
    import copy

    return copy.deepcopy(_load(path)[1])


def _load(path: str) -> tuple[bytes, dict[str, Any]]:
    try:
        st = os.stat(path)
        key = (path, st.st_ino, st.st_size, st.st_mtime_ns) if os.path.isfile(path) else (path, 0, 0, 0)
    except OSError:
        key = (path, 0, 0, 0)
    if key not in _READ:
        _READ[key] = _parse(path, _read(path))
    return _READ[key]


def _read(path: str) -> bytes:
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(21, "Is a directory")
        return read_bounded(path, MAX_CONFIG_BYTES)
    except TooLarge:
        raise UsageError(f"config file {path} is over {MAX_CONFIG_BYTES >> 20} MiB, more than a TRL config holds; "
                         "pass the YAML file of the run to --config") from None
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror}; pass an existing YAML file to --config") \
            from None


def _parse(path: str, data: bytes) -> tuple[bytes, dict[str, Any]]:
    import yaml

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"config file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        _check_size(path, node)
        loaded = yaml.safe_load(text)
    except RecursionError:
        raise UsageError(f"config file {path} is nested over {MAX_DEPTH} levels deep; {_FLAT}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UsageError(f"config file {path} is not valid YAML{where}; fix it or pass another file to --config") \
            from None
    if not isinstance(loaded, dict):
        raise UsageError(f"config file {path} is not a YAML mapping; {_FLAT}")
    return data, loaded


def _check_size(path: str, root: Any) -> None:
    """Walk the node graph as a reader of the loaded data would, aliases expanded, up to the bounds."""
    import yaml

    if root is None:
        return
    stack: list[tuple[Any, int]] = [(root, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise UsageError(f"config file {path} expands to over {MAX_NODES} values (through YAML aliases); "
                             f"{_FLAT}")
        if depth > MAX_DEPTH:
            raise UsageError(f"config file {path} is nested over {MAX_DEPTH} levels deep; {_FLAT}")
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, depth + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend((part, depth + 1) for pair in node.value for part in pair)


def config_path(argv: Sequence[str]) -> str | None:
    """The file `--config` names (TRL takes one `--config FILE`, as a separate word); UsageError for a bare
    `--config` or a second one."""
    words = list(argv)
    count = words.count("--config")
    if count == 0:
        return None
    if count > 1:
        raise UsageError("--config is given twice; TRL reads one config file: merge them into one YAML file")
    i = words.index("--config")
    if i + 1 >= len(words) or words[i + 1].startswith("--"):
        raise UsageError("--config needs a YAML file: --config FILE")
    return words[i + 1]


def checked_config(argv: Sequence[str]) -> str | None:
    """The `--config` file of `argv`, read and checked (UsageError naming what is wrong), or None."""
    path = config_path(argv)
    if path is not None:
        _load(path)
    return path


@contextmanager
def materialized(argv: Sequence[str]) -> Iterator[list[str]]:
    """`argv` with its `--config` file, when that is no regular file (a pipe, `<(...)`), replaced by a temporary
    copy of the bytes read the first time, for TRL's parser, which opens the path itself."""
    words = list(argv)
    path = config_path(words)
    if path is None or os.path.isfile(path):
        if path is not None:
            _load(path)  # checked before TRL reads it
        yield words
        return
    data = _load(path)[0]
    with tempfile.NamedTemporaryFile(prefix="shapeplan-config-", suffix=".yaml") as copy:
        copy.write(data)
        copy.flush()
        i = words.index("--config")
        yield [*words[:i + 1], copy.name, *words[i + 2:]]
