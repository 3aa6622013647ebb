"""One plan warmed by many instances: shard I of N takes its share of the plan's tasks, computed from the plan
alone (`split`, which deals the tasks to `--workers` and to the ranks of `accelerate launch` too), so the shards of
a Slurm array, a Kubernetes Indexed Job or an AWS Batch array job need no coordinator and no lock spanning hosts.
I/N comes from `--shard`, else from the scheduler's environment.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import UsageError
from ..plan.cost import TRAIN_SHAPE_MINUTES

T = TypeVar("T")

_SHARD = re.compile(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*")
_NUMBER = re.compile(r"\s*[0-9]+\s*")
# More shards than any fleet warms one plan with; a count beyond it is a typo or a mis-set variable, refused before
# anything is sized by it.
MAX_SHARDS = 10_000


def task_cost(task: Any) -> tuple[float, int]:
    """Estimated compile minutes of a task (its own estimate, else one train shape), then its size."""
    return float(getattr(task, "cost", TRAIN_SHAPE_MINUTES)), task.batch * task.seq


def _longest_first(task: Any) -> tuple[float, int, str]:
    cost, size = task_cost(task)
    return -cost, -size, task.key


def split(tasks: Sequence[T], count: int) -> list[list[T]]:
    """Longest first: each task, costliest first (ties by task key, so the split depends on the tasks alone, not
    their order), goes to the least loaded share (ties: the lowest share); each share keeps plan order. Shares past
    the number of tasks stay empty (each of the first tasks takes an empty share, the lowest first), so they are
    not searched."""
    used = min(count, len(tasks))
    loads = [0.0] * used
    owner: dict[int, int] = {}
    for i in sorted(range(len(tasks)), key=lambda i: _longest_first(tasks[i])):
        share = min(range(used), key=lambda s: (loads[s], s))
        owner[i] = share
        loads[share] += task_cost(tasks[i])[0]
    return [[t for i, t in enumerate(tasks) if owner[i] == s] for s in range(used)] + [[] for _ in range(count - used)]


@dataclass(frozen=True, slots=True)
class Shard:
    index: int
    count: int
    source: str  # where I/N came from: "--shard", or the scheduler variables read

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    def to_dict(self) -> dict[str, object]:
        return {"index": self.index, "count": self.count, "source": self.source}


def _checked(index: int, count: int, source: str) -> Shard:
    if count < 1:
        raise UsageError(f"shard count {count} from {source} must be at least 1")
    if count > MAX_SHARDS:
        raise UsageError(f"shard count {count} from {source} is over {MAX_SHARDS}, more instances than a plan is "
                         "warmed with; check it, or warm with fewer shards")
    if not 0 <= index < count:
        raise UsageError(f"shard index {index} from {source} must be in 0..{count - 1} (shards count from 0)")
    return Shard(index, count, source)


def _integer(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    if not _NUMBER.fullmatch(value):
        raise UsageError(f"{name}={value!r} is not a non-negative integer; pass --shard I/N")
    return _bounded(value, name)


def _bounded(text: str, source: str) -> int:
    """Digits as an int, refused past any shard index or count before the conversion (Python refuses over 4300
    digits itself, with a traceback); `_checked` bounds the count."""
    digits = text.strip()
    if len(digits.lstrip("0")) > 12:
        raise UsageError(f"{source} {digits[:20]}{'...' if len(digits) > 20 else ''} is far over {MAX_SHARDS} "
                         "shards; check it, or pass --shard I/N")
    return int(digits)


def parse_shard(text: str) -> Shard:
    """`--shard I/N`."""
    match = _SHARD.fullmatch(text)
    if match is None:
        raise UsageError(f"--shard {text!r} is not I/N (e.g. --shard 0/8)")
    return _checked(_bounded(match[1], "--shard index"), _bounded(match[2], "--shard count"), "--shard")


def shard_from_env(env: Mapping[str, str], shard_count: int | None) -> Shard | None:
    """This instance's shard from its scheduler's array variables (Slurm, Kubernetes Indexed Job, AWS Batch);
    None when none is set. Kubernetes exports no count: `shard_count` (--shard-count) supplies it."""
    if "SLURM_ARRAY_TASK_ID" in env:
        task = _integer(env, "SLURM_ARRAY_TASK_ID")
        if "SLURM_ARRAY_TASK_COUNT" in env:
            first = _integer(env, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in env else 0
            return _checked(task - first, _integer(env, "SLURM_ARRAY_TASK_COUNT"),
                            "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT")
        if "SLURM_ARRAY_TASK_MIN" in env and "SLURM_ARRAY_TASK_MAX" in env:
            first, last = _integer(env, "SLURM_ARRAY_TASK_MIN"), _integer(env, "SLURM_ARRAY_TASK_MAX")
            return _checked(task - first, last - first + 1, "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_MIN/MAX")
        raise UsageError("SLURM_ARRAY_TASK_ID is set without SLURM_ARRAY_TASK_COUNT or SLURM_ARRAY_TASK_MIN/MAX; "
                         "pass --shard I/N")
    if "JOB_COMPLETION_INDEX" in env:
        if shard_count is None:
            raise UsageError("JOB_COMPLETION_INDEX is set but Kubernetes exports no shard count; pass --shard-count N "
                             "(the Job's completions)")
        return _checked(_integer(env, "JOB_COMPLETION_INDEX"), shard_count, "JOB_COMPLETION_INDEX/--shard-count")
    if "AWS_BATCH_JOB_ARRAY_INDEX" in env:
        if "AWS_BATCH_JOB_ARRAY_SIZE" not in env:
            raise UsageError("AWS_BATCH_JOB_ARRAY_INDEX is set without AWS_BATCH_JOB_ARRAY_SIZE; pass --shard I/N")
        return _checked(_integer(env, "AWS_BATCH_JOB_ARRAY_INDEX"), _integer(env, "AWS_BATCH_JOB_ARRAY_SIZE"),
                        "AWS_BATCH_JOB_ARRAY_INDEX/AWS_BATCH_JOB_ARRAY_SIZE")
    return None


def resolve_shard(option: str | None, shard_count: int | None, env: Mapping[str, str]) -> Shard | None:
    """`--shard I/N` when given, else the scheduler's environment; `--shard-count` only serves the latter."""
    if shard_count is not None and shard_count < 1:
        raise UsageError(f"--shard-count must be at least 1, not {shard_count}")
    if option is not None:
        if shard_count is not None:
            raise UsageError("--shard-count goes with JOB_COMPLETION_INDEX; with --shard I/N drop it")
        return parse_shard(option)
    found = shard_from_env(env, shard_count)
    if found is None and shard_count is not None:
        raise UsageError("--shard-count needs JOB_COMPLETION_INDEX (a Kubernetes Indexed Job); pass --shard I/N")
    return found


def shard_tasks(tasks: Sequence[T], shard: Shard | None) -> list[T]:
    """The shard's share of the plan's tasks (all of them without a shard), in plan order."""
    return list(tasks) if shard is None else split(tasks, shard.count)[shard.index]
