"""What warming is made of: tasks (one planned shape each), their results, the report. Pure data, no torch."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .shards import Shard

# compiled: something was compiled; cached: it ran and everything came from the cache; eager: it ran where nothing
# compiles (eager CPU/CUDA), which shows it runs and nothing about a cache; failed: it raised; skipped: the manifest
# already records it as warmed in the same environment.
STATUSES: tuple[str, ...] = ("compiled", "cached", "eager", "failed", "skipped")


class Task(Protocol):
    """What the runner, the tracker and the report need of a warmer's task (a `WarmTask`, or the generation
    warm-up's `GenerateTask`): a planned shape, and its stable id in the manifest."""

    @property
    def phase(self) -> str: ...

    @property
    def batch(self) -> int: ...

    @property
    def seq(self) -> int: ...

    @property
    def key(self) -> str: ...

    @property
    def label(self) -> str: ...


@dataclass(frozen=True, slots=True)
class WarmTask:
    """One planned shape to run through the trainer's step.

    `varlen_pairs` are the padding-free (len(cu_seq_lens), max_length_q) pairs the plan met with this shape (each
    gets a batch). `padded` / `unpadded`: whether some of
    the shape's batches hold padding / hold none (attention then skips the mask): each gets a batch.
    `completion_tokens` are DPO's and KTO's per-batch completion-token counts met with this shape, `chosen_rows`
    KTO's numbers of desirable rows (each value needs a batch).
    `per_pass` (eval only) is how many batches of this shape one eval pass runs: the eval loop's concatenations
    grow with every batch, so a warm eval pass runs as many batches as the real one.
    Vision batches carry their images' keys, their `pixel_values` shape and every planned layout of their rows'
    `text_runs` (each gets a batch: see shapeplan/warm/vision.py).
    """

    phase: str
    batch: int
    seq: int
    varlen_pairs: tuple[tuple[int, int], ...] = ()
    padded: bool = True
    unpadded: bool = False
    completion_tokens: tuple[int, ...] = ()
    chosen_rows: tuple[int, ...] = ()
    per_pass: int = 1
    images: tuple[tuple[int, ...], ...] = ()
    pixel_values: tuple[int, ...] | None = None
    text_runs: tuple[tuple[tuple[int, ...], ...], ...] = ()

    @property
    def key(self) -> str:
        """Stable id of the task in the manifest."""
        parts = [self.phase, f"{self.batch}x{self.seq}"]
        if self.varlen_pairs:
            parts.append("pairs=" + ",".join(f"{c}:{q}" for c, q in self.varlen_pairs))
        if self.unpadded:
            parts.append("unpadded" if self.padded else "unpadded-only")
        if self.completion_tokens:
            parts.append("completion=" + ",".join(map(str, self.completion_tokens)))
        if self.chosen_rows:
            parts.append("chosen=" + ",".join(map(str, self.chosen_rows)))
        if self.phase == "eval":
            parts.append(f"per_pass={self.per_pass}")
        if self.images:
            parts.append("grids=" + ",".join("x".join(map(str, grid)) for grid in self.images))
            layouts = repr(self.text_runs).encode()
            parts.append(f"layouts={len(self.text_runs)}:{hashlib.sha256(layouts).hexdigest()[:12]}")
        return " ".join(parts)

    @property
    def label(self) -> str:
        if self.images:
            images = len(self.images)
            return (f"{self.phase} ({self.batch}, {self.seq}) {images} image{'s' if images > 1 else ''}, "
                    f"pixel_values {'x'.join(map(str, self.pixel_values or ()))}")
        return f"{self.phase} ({self.batch}, {self.seq})"


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What happened to one task: status, wall seconds and the compile counters' change while it ran."""

    task: Task
    status: str
    seconds: float
    counters: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    steady_seconds: float | None = None  # one micro-batch run again after compiling (`shapeplan advise --calibrate`)


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """A warmed shape as the manifest records it: the record of completed work in a cache dir."""

    environment: str  # hash of the Environment the shape was warmed in
    task: str  # WarmTask.key
    status: str
    seconds: float
    counters: dict[str, int] = field(default_factory=dict)
    steady_seconds: float | None = None
    plan: str | None = None  # `plan_id` of the plan warmed, for `cache ls` / `cache prune`
    warmed_at: float | None = None  # Unix time the shape finished
    # the compile-cache keys the shape met first, with their compile milliseconds (where the backend names them)
    keys: dict[str, int | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "seconds": round(self.seconds, 3),
                               "counters": dict(sorted(self.counters.items()))}
        if self.steady_seconds is not None:
            out["steady_seconds"] = round(self.steady_seconds, 4)
        if self.plan is not None:
            out["plan"] = self.plan
        if self.warmed_at is not None:
            out["warmed_at"] = round(self.warmed_at, 3)
        if self.keys:
            out["keys"] = dict(self.keys)
        return out


@dataclass(frozen=True, slots=True)
class WarmReport:
    """Everything `shapeplan warm` / `verify` did, in task order."""

    results: tuple[WarmResult, ...]
    cache_dir: str
    device: str
    environment: dict[str, Any]
    script_lines: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    shard: Shard | None = None  # the shard whose share this run warmed (`warm --shard`); None: the whole plan
    # planned shapes that are no task of their own: run inside the tasks' rounds (GRPO/RLOO's train, old_logprob
    # and ref forwards inside each generate size's), as (phase, batch, seq)
    covered: tuple[tuple[str, int, int], ...] = ()

    @property
    def failed(self) -> tuple[WarmResult, ...]:
        return tuple(r for r in self.results if r.status == "failed")

    @property
    def compiled(self) -> tuple[WarmResult, ...]:
        return tuple(r for r in self.results if r.status == "compiled")

    @property
    def eager(self) -> tuple[WarmResult, ...]:
        return tuple(r for r in self.results if r.status == "eager")

    @property
    def environment_variables(self) -> dict[str, str]:
        """The variables of the `export NAME=VALUE` script lines: what training's environment must hold."""
        pairs = (line.removeprefix("export ").partition("=") for line in self.script_lines
                 if line.startswith("export "))
        return {name: value for name, _, value in pairs}

    def to_dict(self) -> dict[str, Any]:
        return {
            "cache_dir": self.cache_dir,
            "device": self.device,
            "environment": self.environment,
            "script_lines": list(self.script_lines),
            "environment_variables": self.environment_variables,
            "warnings": list(self.warnings),
            "shard": self.shard.to_dict() if self.shard else None,
            "results": [
                {"phase": r.task.phase, "batch": r.task.batch, "seq": r.task.seq, "key": r.task.key,
                 "status": r.status, "seconds": round(r.seconds, 3), "counters": dict(sorted(r.counters.items())),
                 **({"error": r.error} if r.error else {})}
                for r in self.results
            ],
            "summary": {s: sum(r.status == s for r in self.results) for s in STATUSES},
            "covered": [{"phase": phase, "batch": batch, "seq": seq} for phase, batch, seq in self.covered],
        }
