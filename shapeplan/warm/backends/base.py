"""The Backend protocol: what the runner needs from a compiler stack."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol


class Backend(Protocol):
    """A compiler stack with a persistent cache.

    `prepare` runs before torch is imported (it sets the environment variables the stack reads at import);
    `configure` runs once the run's settings are known, before the trainer is built; `counters` are monotonic
    totals of this process, compared before and after each shape.
    """

    name: str
    device: str  # the torch device training runs on: "neuron", "cuda" or "cpu"

    def prepare(self, cache_dir: Path, *, scratch: Path | None = None) -> None:
        """Point the stack at `cache_dir`. `scratch`: a private writable folder for the stack's other state (lock
        files), given when `cache_dir` is a throwaway view (verify); None keeps the stack's own default."""
        ...

    def configure(self, *, torch_compile: bool, graphs: int) -> None: ...

    def compiles(self, *, torch_compile: bool) -> bool:
        """Whether a run can compile anything here: eager CPU or CUDA runs no compiler, so a warm-up there warms
        nothing and a verify there proves nothing."""
        ...

    def counters(self) -> dict[str, int]: ...

    def compiled(self, delta: Mapping[str, int]) -> bool:
        """Whether a counter change means something was compiled (a cache miss)."""
        ...

    def hit(self, delta: Mapping[str, int]) -> bool:
        """Whether a counter change shows a persistent-cache hit (code loaded instead of compiled)."""
        ...

    def settings(self) -> dict[str, str]:
        """Versions and compiler settings that are part of the cache key, for the manifest."""
        ...

    def script_lines(self, cache_dir: Path, *, torch_compile: bool, graphs: int) -> tuple[str, ...]:
        """What the training script or its environment must also set to hit the cache warmed here."""
        ...


def new_keys(before: Mapping[str, int | None], after: Mapping[str, int | None]) -> dict[str, int | None]:
    """The compile-cache keys (with their compile milliseconds) in `after` that `before` did not hold."""
    return {key: ms for key, ms in after.items() if key not in before}


def counter_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Non-zero changes of every counter seen before or after."""
    keys = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys) if after.get(k, 0) != before.get(k, 0)}
