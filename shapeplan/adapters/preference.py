"""What the DPO, KTO and Reward adapters share: checking columns, running a trainer's own `_prepare_dataset` on a
bare instance, and reading token lengths off the prepared rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import DatasetError, UsageError


def check_columns(dataset: Any, trainer: str, name: str, accepted: Sequence[Sequence[str]]) -> None:
    """Raise unless the dataset has every column of one of the `accepted` sets (`trainer`: its name, for people)."""
    columns = set(dataset.column_names)
    if "image" in columns or "images" in columns:
        raise UsageError(f"the {name} dataset has images; vision-language {trainer} is not planned yet")
    if any(set(needed) <= columns for needed in accepted):
        return
    wanted = " or ".join("/".join(f"'{c}'" for c in needed) for needed in accepted)
    raise DatasetError(f"the {name} dataset has no {wanted} columns (it has {', '.join(sorted(columns)) or 'none'}); "
                       f"{trainer} needs {wanted}")


def prepare(trainer: Any, dataset: Any, tokenizer: Any, config: Any, name: str) -> Any:
    """`trainer._prepare_dataset(dataset, tokenizer, config, name)`, its failures as one line."""
    try:
        return trainer._prepare_dataset(dataset, tokenizer, config, name)
    except (ValueError, RuntimeError, TypeError, KeyError) as exc:
        text = str(exc).strip()
        message = text.splitlines()[0] if text else type(exc).__name__
        raise DatasetError(f"TRL could not prepare the {name} dataset: {message}") from exc


def list_lengths(prepared: Any, *columns: str) -> list[list[int]]:
    """The length of every row's list in each column, in dataset order."""
    import pyarrow.compute as pc

    # Through the arrow formatter, so the indices mapping that `filter` leaves is honoured.
    table = prepared.select_columns(list(columns)).with_format("arrow")[:]
    return [pc.list_value_length(table.column(c)).to_pylist() for c in columns]


def check_not_empty(num_rows: int, name: str, max_length: int | None, why: str) -> None:
    if num_rows == 0:
        raise DatasetError(f"every row of the {name} dataset was dropped: {why} max_length={max_length}; "
                           "raise --max_length")
