"""`ShapeGuard`: a TrainerCallback that checks a real TRL run against its plan, before each forward, and records
what the run met.

    SFTTrainer(..., callbacks=[ShapeGuard("plan.json", on_unplanned="warn", record="run.json")])
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

from transformers import Trainer, TrainerCallback

from ..errors import UnplannedShapeError, UsageError
from ..plan.counter import ShapeCounter
from ..plan.grpo import pinned_cache
from ..plan.io import keys_tensor, load_plan
from ..plan.model import Plan, Shape, shape_key
from ..plan.rows import BatchImages
from .modes import MODES
from .record import CompileEvent, build_record, gather, write_record
from .recorder import Forward, ShapeRecorder, trainer_method


def _say(line: str) -> None:
    """One line on stderr, on a line of its own: tqdm's write moves a progress bar out of the way (a bar's line
    has no newline while it runs), and is a plain print when no bar is open."""
    from tqdm.auto import tqdm

    # in a log a bar's clearing is a carriage return, not a new line: start one
    start = "\n" if getattr(tqdm, "_instances", None) and not sys.stderr.isatty() else ""
    tqdm.write(f"{start}shapeplan: {line}", file=sys.stderr)
    sys.stderr.flush()


def _calling_trainer() -> Any:
    """The Trainer whose event is being handled: callbacks are given the model, not the trainer, but every event
    is called from one of the Trainer's own methods."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]  # None ends the walk
    raise UsageError("ShapeGuard only works as a callback of a transformers/TRL Trainer: pass it in "
                     "`callbacks=[ShapeGuard(...)]`")


def _varlen_pair(forward: Forward) -> tuple[int, int] | None:
    """A padding-free forward's (len(cu_seq_lens), max_length_q), as a plan's `varlen_pairs` hold them."""
    if forward.cu_seq_lens is None or forward.max_length_q is None:
        return None
    return forward.cu_seq_lens, forward.max_length_q


def _normalised(value: Any) -> Any:
    """A config value as the plan file holds it (enums as their string, tuples as lists)."""
    return json.loads(json.dumps(value, default=str))


def _drift_fix(name: str, planned: Any, value: Any, device: str) -> str:
    """What to do about one drifted option: re-plan, unless the drift is the device's (TRL resolves
    pad_to_multiple_of="auto" to 128 on Neuron only, and a plan is made for Neuron)."""
    if name == "pad_to_multiple_of" and value is None and planned is not None and device != "neuron":
        return (f"on {device} TRL resolves pad_to_multiple_of=\"auto\" to None (to {planned} only on Neuron, which "
                f"the plan is for), so this run pads to other shapes; pass --pad_to_multiple_of {planned} to run the "
                f"planned shapes here, or plan the {device} run with `shapeplan analyze ... --pad_to_multiple_of none`")
    return "re-plan it with `shapeplan analyze`"


def _shown_keys(keys: tuple[dict[str, Any], ...]) -> str:
    """The compile-cache keys a step compiled, as one line's part: each by its parts (the op's or graph's own key
    first, cut at 160 characters) and milliseconds, three at most; then how many it loaded from the cache dir."""
    compiled = [k for k in keys if k["milliseconds"] != 0]  # None: the keys binding alone, which tells no time
    shown = []
    for entry in compiled[:3]:
        first, *rest = entry["parts"].items()
        said = [f"{name} {value}" for name, value in rest]
        if entry["milliseconds"] is not None:
            said.append(f"{entry['milliseconds']} ms")
        text = repr(first[1] if len(first[1]) <= 160 else first[1][:160] + "...")
        shown.append(f"{text} ({', '.join(said)})" if said else text)
    line = ", ".join(shown) + (f" and {len(compiled) - 3} more" if len(compiled) > 3 else "")
    loaded = len(keys) - len(compiled)
    if not loaded:
        return line
    return f"{line}; {loaded} more loaded from the cache dir" if line else f"{loaded} loaded from the cache dir"


def _shown_shapes(keys: list[tuple[Any, ...]]) -> str:
    return ", ".join(f"{k[0]} {(k[1], k[2])}" for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3
                                                                   else "") or "no new shape"


class ShapeGuard(TrainerCallback):
    """Checks every input shape a trainer's models receive against `plan`, before the forward runs.

    `on_unplanned`: `warn` (one line, plus `shapeplan/unplanned` in the Trainer's logs), `error`
    (`UnplannedShapeError` before the forward) or `record` (only records). `record`: a path the run record is written
    to at the end (the plan schema with `"observed": true`). `backend`: the compile backend whose counters are read
    at step boundaries (default: the warm-up's, for the device training runs on). `on_forward` is called with every
    recorded input (the oracle tests collect them). `no_compile`: any compile during training is an error
    (`UnplannedShapeError` at the step boundary that counted it), for the run after a bake, as vLLM-Neuron's
    VLLM_NEURON_DISABLE_WARMUP_COMPILE makes any cache miss fatal.
    """

    def __init__(self, plan: str | os.PathLike[str] | Plan | None = None, *, on_unplanned: str = "warn",
                 record: str | os.PathLike[str] | None = None, backend: Any = None,
                 on_forward: Callable[[Forward], None] | None = None, no_compile: bool = False) -> None:
        if on_unplanned not in MODES:
            raise UsageError(f"on_unplanned={on_unplanned!r}; choose one of {', '.join(MODES)}")
        self.plan = load_plan(plan) if isinstance(plan, (str, os.PathLike)) else plan
        self.plan_name = str(plan) if isinstance(plan, (str, os.PathLike)) else "the plan"
        self.mode = on_unplanned
        self.record_path = Path(record) if record is not None else None
        self.backend = backend
        self.on_forward = on_forward
        self.no_compile = no_compile
        # a family whose batches do not hold their images' keys is checked by its pixel tensor's shape
        self._keyed = self.plan is not None and keys_tensor(self.plan.config) is not None
        self.planned: dict[tuple[Any, ...], Shape] = {} if self.plan is None else {
            shape_key(s, images=self._keyed): s for s in self.plan.shapes}
        self.trainer: Any = None
        self.recorder: ShapeRecorder | None = None
        self.counter = ShapeCounter()
        self.unplanned: dict[tuple[Any, ...], Forward] = {}  # the first forward of each unplanned shape
        self.drift: list[str] = []
        self.compiles: list[CompileEvent] = []
        self.summary = ""
        self.stale: list[str] = []  # "planned N x phase (b, s), met M": certain shapes met another number of times
        self._seen: set[tuple[Any, ...]] = set()
        # what happened since the last step boundary, for attributing compiles and time
        self._interval_keys: dict[tuple[Any, ...], int] = {}
        self._new_keys: list[tuple[Any, ...]] = []
        self._new_unplanned = 0
        self._seconds: dict[tuple[Any, ...], list[float]] = {}
        self._steady: list[float] = []
        self._counters: dict[str, int] = {}
        self._clock = 0.0
        # the backend's compile-cache keys (`compile_keys`, where it names them) held at the last boundary
        self._read_keys: Callable[[], dict[str, int | None] | None] | None = None
        self._held_keys: dict[str, int | None] = {}
        self.uncounted: str | None = None  # why compiles cannot be counted, when they cannot
        if importlib.util.find_spec("torch_neuronx") is not None:
            from ..warm.backends.neuron import enable_metrics

            # built before the Trainer moves the model: TorchNeuron counts nothing unless metrics are on
            self.uncounted = enable_metrics()

    # -- attaching ------------------------------------------------------------------------------------------------

    def _attach(self) -> None:
        if self.recorder is not None:
            return
        self.trainer = _calling_trainer()
        method = trainer_method(self.trainer)
        if self.plan is not None and self.plan.method != method:
            raise UsageError(f"{self.plan_name} is a {self.plan.method} plan but the run is {method} "
                             f"({type(self.trainer).__name__}); plan this run with `shapeplan analyze --method "
                             f"{method}`")
        if self.plan is not None and self.plan.config.get("pad_tool_turns"):
            from ..adapters.tool_turns import pad_tool_turns

            pad_tool_turns(self.trainer)  # the run the plan is of: its tool turns generate on the round's rows
        pin = pinned_cache(self.plan) if self.plan is not None else None
        if pin is not None:
            from ..adapters.tool_turns import pin_cache

            pin_cache(self.trainer, pin)  # the run the plan is of: every generate at the one cache length
        self.recorder = ShapeRecorder(self.trainer, self._met, method=method)
        self.recorder.attach()
        if self.backend is None:
            from ..warm.backends import make_backend

            device = self.trainer.args.device.type
            self.backend = make_backend(device if device in ("neuron", "cuda") else "cpu")
            watch = getattr(self.backend, "watch", None)  # a run shapeplan did not prepare: count in its cache
            if watch is not None:
                self.uncounted = watch()
        if self.uncounted:
            if self.no_compile:
                raise UsageError(f"no_compile needs the compile counters: {self.uncounted}")
            _say(self.uncounted)
        if self.plan is not None:
            from ..warm.runner import graph_bound

            # the compiler settings `shapeplan warm` used (and prints for training scripts), so the run hits its cache
            graphs = graph_bound(self.plan.shapes)
            self.backend.configure(torch_compile=bool(self.trainer.args.torch_compile), graphs=graphs)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._attach()  # before DPO/KTO's precompute pass, which runs after the base Trainer's __init__

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._attach()  # a guard added with `trainer.add_callback` sees no on_init_end
        assert self.recorder is not None
        self.recorder.start_training()
        if self.recorder.precomputed_from_cache:
            _say(f"TRL read the reference log-probs of the {' and '.join(self.recorder.precomputed_from_cache)} "
                 "dataset from its datasets cache: that precompute pass did not run (its planned ref_precompute "
                 "shapes are not expected)")
        if self.plan is not None:
            self._check_drift(state)
        self._start_counting()

    def _start_counting(self) -> None:
        """Read the counters (and the compile-cache keys, where the backend names them) that step boundaries are
        compared with: what ran before is charged to no step."""
        self._counters = self._read_counters()
        self._read_keys = getattr(self.backend, "compile_keys", None)
        self._held_keys = self._keys_now()
        self._clock = time.perf_counter()

    # -- before each forward --------------------------------------------------------------------------------------

    def _met(self, forward: Forward) -> None:
        key = forward.key
        if self.planned and key not in self.planned and key not in self.unplanned:
            self._unplanned(forward)
        pair = _varlen_pair(forward)
        if pair is not None and key in self.planned and self.planned[key].varlen_pairs and \
                pair not in self.planned[key].varlen_pairs and (*key, pair) not in self.unplanned:
            # padding-free: each (len(cu_seq_lens), max_length_q) pair is a graph of its own
            self._unplanned(forward, (*key, pair))
        if self.on_forward is not None:
            self.on_forward(forward)
        if key not in self._seen:
            self._seen.add(key)
            self._new_keys.append(key)
        self._interval_keys[key] = self._interval_keys.get(key, 0) + 1
        planned = self.planned.get(key)
        self.counter.add(forward.phase, forward.batch, forward.seq, forward.step, cache_len=forward.cache_len,
                         max_new_tokens=planned.max_new_tokens if planned else self._max_new_tokens(forward),
                         logits_to_keep=forward.logits_to_keep, cu_seq_lens=forward.cu_seq_lens,
                         max_length_q=forward.max_length_q, unpadded=forward.unpadded,
                         completion_tokens=forward.completion_tokens, chosen_rows=forward.chosen_rows,
                         vision=BatchImages(pixel_values=forward.pixel_values, images=forward.images))

    def _max_new_tokens(self, forward: Forward) -> int | None:
        if not forward.phase.endswith("generate"):
            return None
        return int(getattr(self.trainer.args, "max_completion_length", 0)) or None

    def _unplanned(self, forward: Forward, key: tuple[Any, ...] | None = None) -> None:
        self.unplanned[key or forward.key] = forward
        where = f"{forward.phase} {(forward.batch, forward.seq)}"
        if forward.cache_len is not None:
            where += f" cache_len {forward.cache_len}"
        if forward.turn is not None:
            where += f" in tool turn {forward.turn}"
        if forward.logits_to_keep is not None:
            where += f" logits_to_keep {forward.logits_to_keep}"
        if forward.pixel_values is not None:
            where += f" with pixel_values {list(forward.pixel_values)} of {len(forward.images)} images"
        if key is not None:
            where += f" with cu_seq_lens of {forward.cu_seq_lens} and max_length_q {forward.max_length_q}"
        compiles = self.backend.compiles(torch_compile=bool(getattr(self.trainer.args, "torch_compile", False)))
        outcome = "so it compiles now" if compiles else \
            f"(eager on {self.backend.device}: 0 compiles, so it costs nothing here)"
        # once a drift line named the cause, the fix is that line's; else the plan no longer fits the run
        fix = "the drift above is why: fix that" if self.drift else \
            "re-plan this run with `shapeplan analyze` and `shapeplan warm` it"
        message = f"unplanned shape {where} at step {forward.step} (rank {forward.rank}): not in {self.plan_name}, " \
                  f"{outcome}; {fix}"
        if self.mode == "error":
            raise UnplannedShapeError(message)
        self._new_unplanned += 1
        if self.mode == "warn":
            _say(message)

    # -- step boundaries: compiles and time -----------------------------------------------------------------------

    def _read_counters(self) -> dict[str, int]:
        if self.backend.device == "neuron":
            import torch

            # Neuron compiles on a thread of its own: its counters are read after a sync
            torch.neuron.synchronize()  # type: ignore[attr-defined]  # torch-neuronx adds torch.neuron
        return dict(self.backend.counters())

    def _keys_now(self) -> dict[str, int | None]:
        keys = self._read_keys() if self._read_keys is not None else None
        if keys is None:  # the backend cannot name its keys (TorchNeuron without the cache-entry bindings)
            self._read_keys = None
        return keys or {}

    def _first_met_keys(self) -> tuple[dict[str, Any], ...]:
        """The compile-cache keys first met since the last boundary, with their milliseconds and parts."""
        from ..warm.backends.base import new_keys

        if self._read_keys is None:
            return ()
        held = self._keys_now()
        new = new_keys(self._held_keys, held)
        self._held_keys = held
        parts = getattr(self.backend, "key_parts", None)
        return tuple({"key": key, "milliseconds": ms, "parts": parts(key) if parts is not None else {"key": key}}
                     for key, ms in new.items())

    def _boundary(self, state: Any) -> dict[str, float]:
        """Close the interval since the last boundary: attribute its compiles and seconds."""
        from ..warm.backends.base import counter_delta

        now = time.perf_counter()
        seconds, self._clock = now - self._clock, now
        counters = self._read_counters()
        delta, self._counters = counter_delta(self._counters, counters), counters
        keys = self._first_met_keys()
        logs: dict[str, float] = {}
        forwards = sum(self._interval_keys.values())
        if self.backend.compiled(delta):
            shapes = self._new_keys or list(self._interval_keys)
            steady = median(self._steady) if self._steady else 0.0
            event = CompileEvent(step=int(state.global_step), shapes=tuple(shapes), delta=delta,
                                 seconds=max(0.0, seconds - steady), keys=keys)
            self.compiles.append(event)
            named = f"; keys: {_shown_keys(keys)}" if keys else ""
            if self.no_compile:
                raise UnplannedShapeError(
                    f"a compile during training at step {event.step} ({_shown_shapes(shapes)}; counters moved: "
                    f"{', '.join(f'{k}={v:+d}' for k, v in sorted(delta.items()) if v)}{named}), and the guard "
                    "forbids any: the bake did not cover this run; record it with `shapeplan guard --record RUN` "
                    "and `shapeplan warm --plan RUN`")
            compiled = sum(k["milliseconds"] != 0 for k in keys)
            if compiled:  # which op or graph compiled, where the backend names its keys
                _say(f"step {event.step} compiled {compiled} key(s) ({_shown_shapes(shapes)}): {_shown_keys(keys)}")
            logs.update({"shapeplan/compiles": float(len(self.compiles)),
                         "shapeplan/compile_seconds": round(sum(e.seconds for e in self.compiles), 3)})
        elif forwards:
            self._steady.append(seconds)
            for key in self._interval_keys:  # an interval's time, shared evenly among its forwards
                self._seconds.setdefault(key, []).append(seconds / forwards)
        if self._new_unplanned:
            logs["shapeplan/unplanned"] = float(len(self.unplanned))
            self._new_unplanned = 0
        self._interval_keys, self._new_keys = {}, []
        return logs

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        logs = self._boundary(state)
        if logs:
            self.trainer.log(logs)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        logs = self._boundary(state)
        if logs:
            self.trainer.log(logs)

    # -- drift at the start, counts and the summary at the end ----------------------------------------------------

    def _check_drift(self, state: Any) -> None:
        from ..adapters.common import recorded_options
        from ..adapters.data import tokenizer_fingerprint

        assert self.plan is not None
        run = _normalised(recorded_options(self.trainer.args))
        found = [(name, self.plan.config[name], value) for name, value in sorted(run.items())
                 if name in self.plan.config and self.plan.config[name] != value]
        world = int(self.trainer.args.world_size)
        if "num_processes" in self.plan.config and self.plan.config["num_processes"] != world:
            found.append(("world size", self.plan.config["num_processes"], world))
        pad = getattr(self.trainer.args, "pad_to_multiple_of", "auto")  # TRL resolves "auto" for the device
        if pad != "auto" and pad != self.plan.pad_to_multiple_of:
            found.append(("pad_to_multiple_of", self.plan.pad_to_multiple_of, pad))
        tokenizer = getattr(self.trainer, "processing_class", None)
        planned_tokenizer = self.plan.fingerprint.get("tokenizer")
        # a processor (vision models) is fingerprinted by its tokenizer only where it is one
        if planned_tokenizer and hasattr(tokenizer, "chat_template") and \
                tokenizer_fingerprint(tokenizer) != planned_tokenizer:
            found.append(("tokenizer", planned_tokenizer, tokenizer_fingerprint(tokenizer)))
        if self.plan.exact and state.max_steps != self.plan.stats.optimizer_steps:
            # the data's size after preparation decides the step count: a changed dataset shows here
            found.append(("optimizer steps (data)", self.plan.stats.optimizer_steps, state.max_steps))
        device = getattr(getattr(self.trainer.args, "device", None), "type", "neuron")
        for name, planned, value in found:
            line = f"drift: the plan was made for {name}={planned!r}, this run has {value!r}; " \
                   f"{_drift_fix(name, planned, value, device)}"
            self.drift.append(line)
            _say(line)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        logs = self._boundary(state)
        if logs:
            self.trainer.log(logs)
        assert self.recorder is not None
        self.recorder.detach()
        merged = gather(self.counter.shapes(), self.compiles, self._seconds)
        if merged is None:  # not rank 0: rank 0 reports for the run
            return
        shapes, compiles, seconds = merged
        self.summary = self._summarise(shapes, compiles)
        _say(self.summary)
        if self.record_path is not None:
            write_record(self.record_path, build_record(self.trainer, self.plan, shapes, compiles, seconds,
                                                        steps=int(state.global_step)))

    def _summarise(self, shapes: tuple[Shape, ...], compiles: list[CompileEvent]) -> str:
        met = {shape_key(s): s for s in shapes}
        unplanned = len([k for k in met if self.planned and k not in self.planned])
        unplanned += sum(len(set(s.varlen_pairs) - set(self.planned[k].varlen_pairs)) for k, s in met.items()
                         if k in self.planned and self.planned[k].varlen_pairs)
        compiled = f"{len(compiles)} compile{'s' if len(compiles) != 1 else ''}"
        if self.uncounted:
            compiled = "compiles not counted"
        if self.plan is None:
            return f"{len(met)} shapes met, {compiled}"
        expected = {key: s for key, s in self.planned.items() if self._expected(s)}
        certain = [s for s in expected.values() if s.certain]
        possible = [s for s in expected.values() if not s.certain]
        hit = sum(1 for s in certain if shape_key(s, images=self._keyed) in met)
        line = f"{hit}/{len(certain)} planned shapes met"
        if possible:  # shapes only sampling can produce (GRPO completion buckets): a run meets some of them
            line += (f" (and {sum(1 for s in possible if shape_key(s, images=self._keyed) in met)}/{len(possible)} "
                     "possible ones)")
        line += f", {unplanned} unplanned, {compiled}"
        if not self.plan.exact:
            return line + ", counts not compared (the plan is a bound)"
        stale = []
        for key, s in expected.items():
            got = met[key].count if key in met else 0
            # a certain shape that tool calls can also produce: its certain count, up to its max_count
            if s.certain and not s.count <= got <= (s.max_count or s.count):
                stale.append(f"planned {s.count if s.max_count is None else f'{s.count}..{s.max_count}'} x "
                             f"{s.phase} {(s.batch, s.seq)}, met {got}")
        self.stale = stale
        # after a drift the counts differ because of it: the verdict names the drift, not a stale plan
        why = "because of the drift above" if self.drift else "the plan is stale"
        for line_ in stale:
            _say(f"{line_}: {why}")
        return line + (", counts as planned" if not stale else f", {len(stale)} counts differ: {why}")

    def _expected(self, shape: Shape) -> bool:
        """Whether the run was to meet `shape`: not a precompute pass's shape once TRL read any of that pass's result
        from its cache (the plan merges the train and eval passes' shapes, so neither is counted then)."""
        assert self.recorder is not None
        return not (shape.phase == "ref_precompute" and self.recorder.precomputed_from_cache)
