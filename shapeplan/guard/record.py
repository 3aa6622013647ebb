"""The run record: what a guarded run met, in the plan schema (`"observed": true`), so that `shapeplan warm --plan
run.json` warms exactly that. Ranks' shapes are merged the way a plan merges them (counts summed, the earliest first
step, the union of padding-free values); each shape also carries `seconds` (steady-state seconds per micro-batch)
and the record lists the run's `compiles` (step, seconds, the shapes first met then, counter changes and, where
the backend names them, the compile-cache keys first met then, with their parts).
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any

from ..errors import PlanFileError
from ..plan.counter import shape_sort_key
from ..plan.io import plan_to_dict, shape_to_dict
from ..plan.model import Plan, PlanStats, Shape, shape_key
from ..plan.targets import write_output
from .recorder import trainer_method

Key = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class CompileEvent:
    """Something compiled between two step boundaries: the step it ended at, the shapes first met in that interval
    (every shape of the interval when none was new), the backend's counter changes, the interval's time beyond
    a steady step's and, where the backend names its compile-cache keys (`compile_keys`: TorchNeuron's cache-entry
    bindings), the keys first met in the interval, each as {"key", "milliseconds" (0: loaded from the cache dir;
    None: not told), "parts"}."""

    step: int
    shapes: tuple[Key, ...]
    delta: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    keys: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "seconds": round(self.seconds, 3), "counters": self.delta,
                **({"keys": [dict(k) for k in self.keys]} if self.keys else {}),
                "shapes": [{"phase": k[0], "batch": k[1], "seq": k[2],
                            **({"cache_len": k[3]} if k[3] is not None else {}),
                            **({"logits_to_keep": k[4]} if k[4] is not None else {}),
                            **({"image_grid_thw": [list(g) for g in k[5]]} if k[5] else {})} for k in self.shapes]}


def merge_shapes(shapes: list[Shape]) -> tuple[Shape, ...]:
    """Entries of the same graph (several ranks') as one: counts summed, the earliest first step, values united."""
    merged: dict[Key, Shape] = {}
    for s in shapes:
        m = merged.get(s.key)
        if m is None:
            merged[s.key] = s
            continue
        merged[s.key] = replace(
            m, count=m.count + s.count, first_step=min(m.first_step, s.first_step),
            cu_seq_lens=tuple(sorted({*m.cu_seq_lens, *s.cu_seq_lens})),
            max_length_q=tuple(sorted({*m.max_length_q, *s.max_length_q})),
            varlen_pairs=tuple(sorted({*m.varlen_pairs, *s.varlen_pairs})), unpadded=m.unpadded + s.unpadded)
    return tuple(sorted(merged.values(), key=shape_sort_key))


def gather(shapes: tuple[Shape, ...], compiles: list[CompileEvent], seconds: dict[Key, list[float]]) -> tuple[
        tuple[Shape, ...], list[CompileEvent], dict[Key, list[float]]] | None:
    """Every rank's shapes, compiles and timings merged on rank 0 (None on the other ranks)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return merge_shapes(list(shapes)), compiles, seconds
    # Through the launcher's key-value store, not a collective: over the run's (neuron) group the pickled payload
    # is a collective of a size the run never used, compiled after its last step; over gloo, a rank that exits
    # right after the gather can abort in teardown (gloo's worker thread frees the gather's tensors after the
    # interpreter has begun finalizing: "terminate called without an active exception").
    from torch.distributed.distributed_c10d import _get_default_store

    parts = exchange(_get_default_store(), f"shapeplan/guard/{next(_exchanges)}", dist.get_rank(),
                     dist.get_world_size(), (shapes, compiles, seconds))
    if parts is None:
        return None
    all_seconds: dict[Key, list[float]] = {}
    for _, _, part in parts:
        for key, values in part.items():
            all_seconds.setdefault(key, []).extend(values)
    return (merge_shapes([s for part_shapes, _, _ in parts for s in part_shapes]),
            [e for _, part_compiles, _ in parts for e in part_compiles], all_seconds)


_exchanges = itertools.count()  # every rank gathers once per trained Trainer, so the n-th exchanges agree


def exchange(store: Any, prefix: str, rank: int, world_size: int, part: Any) -> list[Any] | None:
    """Every rank's `part`, in rank order, on rank 0 (None on the others), through a `torch.distributed.Store`:
    each other rank sets its pickled part under `prefix/RANK`, rank 0 waits for each key and deletes it."""
    if rank != 0:
        store.set(f"{prefix}/{rank}", pickle.dumps(part))
        return None
    parts = [part]
    for other in range(1, world_size):
        parts.append(pickle.loads(store.get(f"{prefix}/{other}")))  # the run's own ranks wrote it
        store.delete_key(f"{prefix}/{other}")
    return parts


def build_record(trainer: Any, plan: Plan | None, shapes: tuple[Shape, ...], compiles: list[CompileEvent],
                 seconds: dict[Key, list[float]], *, steps: int) -> dict[str, Any]:
    """The run record as a plan-schema dict. With a plan, its config and fingerprint (so `shapeplan warm --plan`
    rebuilds the same run); without one, the run's recorded options."""
    from ..adapters.common import recorded_options, versions

    train = [s for s in shapes if s.phase == "train"]
    config = dict(plan.config) if plan is not None else {
        "num_processes": int(trainer.args.world_size), **json.loads(json.dumps(
            recorded_options(trainer.args), default=str))}
    pad = plan.pad_to_multiple_of if plan is not None else getattr(trainer.args, "pad_to_multiple_of", None)
    dataset: Any = getattr(trainer, "train_dataset", None)
    record = Plan(
        method=plan.method if plan is not None else trainer_method(trainer), exact=True,
        pad_to_multiple_of=pad if isinstance(pad, int) else None, shapes=shapes,
        # a record counts no real tokens (that would read every mask): `tokens` is 0, `padded_tokens` what ran
        stats=PlanStats(rows=len(dataset) if hasattr(dataset, "__len__") else 0, dropped_rows=0,
                        micro_batches=sum(s.count for s in train), optimizer_steps=steps, tokens=0,
                        padded_tokens=sum(s.count * s.batch * s.seq for s in train)),
        config=config, versions=versions(), fingerprint=dict(plan.fingerprint) if plan is not None else {},
        observed=True)
    data = plan_to_dict(record)
    data["shapes"] = [{**shape_to_dict(s, record.config), **({"seconds": round(median(seconds[shape_key(s)]), 6)}
                                              if seconds.get(shape_key(s)) else {})} for s in shapes]
    data["compiles"] = [e.to_dict() for e in compiles]
    return data


def write_record(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    try:
        write_output(path, json.dumps(data, indent=2) + "\n", "--record")
    except OSError as exc:
        raise PlanFileError(f"cannot write the run record to {path}: {exc.strerror}; choose a writable path for "
                            "--record") from exc
