"""Aggregates the shapes met batch by batch into `Shape` entries."""

from __future__ import annotations

from dataclasses import dataclass, field

from .model import PHASES, Phase, Shape, ShapeKey
from .rows import NO_IMAGES, BatchImages


@dataclass(slots=True)
class _Entry:
    count: int  # certain occurrences
    first_step: int  # of the certain occurrences (of the possible ones in an entry that has none)
    possible: int = 0  # occurrences only some runs meet (sampling, tool calls)
    cu_seq_lens: set[int] = field(default_factory=set)
    max_length_q: set[int] = field(default_factory=set)
    varlen_pairs: set[tuple[int, int]] = field(default_factory=set)
    unpadded: int = 0
    completion_tokens: set[int] = field(default_factory=set)
    chosen_rows: set[int] = field(default_factory=set)
    vision_inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()  # follows from the key's images and seq
    text_runs: dict[tuple[tuple[int, ...], ...], None] = field(default_factory=dict)  # distinct layouts, in order


class ShapeCounter:
    """Counts each distinct shape and remembers the first step that met it."""

    def __init__(self) -> None:
        self._entries: dict[ShapeKey, _Entry] = {}

    def add(
        self,
        phase: Phase,
        batch: int,
        seq: int,
        step: int,
        *,
        count: int = 1,
        certain: bool = True,
        cache_len: int | None = None,
        max_new_tokens: int | None = None,
        logits_to_keep: int | None = None,
        cu_seq_lens: int | None = None,
        max_length_q: int | None = None,
        completion_tokens: tuple[int, ...] = (),
        chosen_rows: int | None = None,
        unpadded: bool = False,
        vision: BatchImages = NO_IMAGES,
        text_runs: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        key = ShapeKey(phase, batch, seq, cache_len, max_new_tokens, logits_to_keep, vision.images, vision.pixel_values)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(count=0, first_step=step, vision_inputs=vision.inputs)
        if certain:
            entry.first_step = step if entry.count == 0 else min(entry.first_step, step)
            entry.count += count
        else:
            if entry.count == 0:
                entry.first_step = min(entry.first_step, step)
            entry.possible += count
        if cu_seq_lens is not None:
            entry.cu_seq_lens.add(cu_seq_lens)
        if max_length_q is not None:
            entry.max_length_q.add(max_length_q)
        if cu_seq_lens is not None and max_length_q is not None:
            entry.varlen_pairs.add((cu_seq_lens, max_length_q))
        if unpadded:
            entry.unpadded += count
        entry.completion_tokens.update(completion_tokens)
        if chosen_rows is not None:
            entry.chosen_rows.add(chosen_rows)
        if text_runs:
            entry.text_runs[text_runs] = None

    def shapes(self) -> tuple[Shape, ...]:
        out = [
            Shape(
                phase=key.phase,
                batch=key.batch,
                seq=key.seq,
                count=e.count or e.possible,
                first_step=e.first_step,
                certain=e.count > 0,
                max_count=e.count + e.possible if e.count and e.possible else None,
                cache_len=key.cache_len,
                max_new_tokens=key.max_new_tokens,
                logits_to_keep=key.logits_to_keep,
                cu_seq_lens=tuple(sorted(e.cu_seq_lens)),
                max_length_q=tuple(sorted(e.max_length_q)),
                varlen_pairs=tuple(sorted(e.varlen_pairs)),
                unpadded=e.unpadded,
                completion_tokens=tuple(sorted(e.completion_tokens)),
                chosen_rows=tuple(sorted(e.chosen_rows)),
                pixel_values=key.pixel_values,
                images=key.images,
                vision_inputs=e.vision_inputs,
                text_runs=tuple(e.text_runs),
            )
            for key, e in self._entries.items()
        ]
        return tuple(sorted(out, key=shape_sort_key))


def shape_sort_key(shape: Shape) -> tuple[object, ...]:
    order = PHASES.index(shape.phase) if shape.phase in PHASES else len(PHASES)
    return (order, shape.batch, shape.seq, shape.cache_len or 0, shape.max_new_tokens or 0, shape.logits_to_keep or 0,
            shape.images)
