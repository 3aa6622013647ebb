"""Generation trainers (GRPO, RLOO; Distillation can reuse it): the shapes each `generate` round and the forwards
over its completions feed the model, from prompt lengths, the sampler's batches and the config.

The prompt side is exact: the prompt bucket P of every round follows from the prompts, the sampler's order and
the padding multiple, and so does the static cache length (a running maximum kept on the model across calls).
The completion bucket C = R(longest completion) depends on sampling, so every C in `completion_buckets` is planned
for every P; those entries are `certain` only when there is a single bucket.

With images (`images`: the prompts' grids, vision-language GRPO), each `generate` carries its rows' image encode
and each forward its rows' pixel batch, in row order, but for the train forwards: the trainer shuffles a round's
rows (with the global RNG) before cutting its micro-batches, so a train entry's grids are keyed in sorted order, one
entry for every order of the same images; where a micro-batch is a slice of the round (steps_per_generation > 1),
it can hold any of its rows, so each choice of prompts' images it can hold is a possible entry (`_slices`; certain
where every choice holds the same images).

With tools (`ToolLoop`), each round's first `generate` is followed by up to `turns` more, each on the rows whose
last completion called a tool (num_generations 1), over prompt + completion + tool response: what the model
writes decides them, so they are planned as a bound (`certain` False), and so is every cache length they can grow.
Which rows call is the model's choice too, so a turn's batch is any of 1..R, unless the run pads each turn to the
round's R rows (`ToolLoop.padded`: `shapeplan.pad_tool_turns`). The bound is what each turn can reach from the
turns before it (`ToolLoop.reach`): turn t meets a bucket only where some row, t turns grown, can round up to it,
and k rows only where k rows fit in it; turn 1 meets the cache the round's first `generate` left, grown by its own
bucket, and a later turn also any an earlier turn of the round can have left (a row that reached a higher bucket
may leave the loop). An entry's count is the number of turns that can meet it.

With a `rollout_func` (`Rollout`), the user's function makes a round's `generate` calls and returns its prompt and
completion ids: each round is what the function does with its prompts when every completion is as short as it can
be and as long as it can be (the adapter runs it so). Its first call is certain; every later call, and the
completion buckets, span what lies between.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .batches import RankBatches
from .buckets import round_up
from .counter import ShapeCounter
from .model import GENERATE_PHASES, Method, Phase, Plan, PlanStats, Shape
from .rows import NO_IMAGES, BatchImages, Rows
from .schedule import TrainLoop, micro_batches


@dataclass(frozen=True, slots=True)
class GenerationLayout:
    """How the trainer generates and batches, as TRL's config names it.

    One dataloader batch holds a rank's generation batch (`batch_size * steps_per_generation` rows, a
    `num_processes`-th of that under accelerate's split_batches); the trainer generates on it every
    `steps_per_generation * num_iterations` micro-steps and trains on its `steps_per_generation` equal slices
    (`split_tensor_dict`). `round_forwards` are the no-grad forwards run over each generation batch in chunks of
    `batch_size` (GRPO: `old_logprob` and/or `ref`; Distillation: `teacher`); `eval_forwards` the forwards run on
    each eval batch (GRPO: `eval` for the loss, plus `eval` again for old log-probs and `ref`).
    """

    batch_size: int
    steps_per_generation: int
    num_iterations: int
    pad_to_multiple_of: int | None
    max_new_tokens: int
    static_cache: bool
    max_cache_len: int | None  # generation_config.max_cache_len: a floor for the static cache length
    round_forwards: tuple[Phase, ...]
    eval_batch_size: int  # per_device_eval_batch_size: the chunk size of the eval batches' no-grad forwards
    eval_forwards: tuple[Phase, ...]
    tool_loop: ToolLoop | None = None  # the trainer's tool loop, where it runs
    # the run pins the static cache at the longest length any of its calls needs (`max_cache_len`, shapeplan's
    # default with a tool loop or a rollout function): every call then has that one length, which the plan finds
    # (`plan_generation`; a rollout function's calls of the model's own `generate` leave the run unpinned)
    pin_cache: bool = False

    @property
    def generate_every(self) -> int:
        return self.steps_per_generation * self.num_iterations


@dataclass(frozen=True, slots=True)
class ToolLoop:
    """The bound of GRPOTrainer's tool loop (`_tool_call_loop`): after a round's first `generate`, up to `turns`
    more, each on k of the round's R rows (those whose completion called a tool, 1 <= k <= R) over prompt +
    completion + tool response, a sequence that grows by at least `min_growth` tokens a turn (the call and the
    response's formatting) and whose part past the prompt the trainer keeps within `max_completion_length` (longer
    ones leave the loop). `padded`: the run pads each turn to the round's R rows (`shapeplan.pad_tool_turns`), so
    k is R."""

    turns: int
    min_growth: int
    max_completion_length: int
    padded: bool = False

    def buckets(self, prompt_lengths: Sequence[int], multiple: int | None) -> tuple[int, ...]:
        """The padded prompt lengths a turn can meet for a round of these prompts."""
        low = min(prompt_lengths) + self.min_growth
        high = max(prompt_lengths) + self.max_completion_length
        return () if low > high else _spanned(low, high, multiple)

    def reach(self, prompt_lengths: Sequence[int], multiple: int | None) -> dict[int, tuple[int, ...]]:
        """Each padded prompt length the turns of a round of these prompts can meet, with, for k = 1..R (index
        k - 1), the number of turns that can meet it on k rows. A row in turn t is its prompt grown by at least
        t x `min_growth` tokens and at most `max_completion_length`: the bucket is met in turn t where some row can
        round up to it, on k rows where the k shortest prompts, t turns grown, fit in it."""
        step = multiple or 1
        ordered = sorted(prompt_lengths)
        out = {}
        for bucket in self.buckets(ordered, multiple):
            # the row that sets the bucket is longer than the bucket below; the others only fit in it
            most = min(self.turns, max(((bucket - length) // self.min_growth for length in ordered
                                        if length + self.max_completion_length > bucket - step), default=0))
            if most >= 1:
                out[bucket] = tuple(max(0, min(most, (bucket - length) // self.min_growth)) for length in ordered)
        return out


@dataclass(frozen=True, slots=True)
class OwnGenerate:
    """A rollout function's call of the model's `generate` itself (not through `trainer._generate_single_turn`): the
    settings that size its static cache, and the multiple it pads its prompts to (None: to their longest row)."""

    max_new_tokens: int
    static_cache: bool
    max_cache_len: int | None
    multiple: int | None


@dataclass(frozen=True, slots=True)
class RolloutCall:
    """One `generate` call of a rollout function: `rows` prompts whose longest is `shortest` tokens when every
    earlier completion is as short as it can be, `longest` when every one is as long; for a call of the model's own
    `generate` (`own`), the widths of the padded prompts it passed."""

    rows: int
    shortest: int
    longest: int
    own: OwnGenerate | None = None

    def buckets(self, multiple: int | None) -> tuple[int, ...]:
        if self.own is None:
            return _spanned(self.shortest, self.longest, multiple)
        if self.shortest == self.longest:  # a width that does not follow the prompts (padding="max_length")
            return (self.shortest,)
        return _spanned(self.shortest, self.longest, self.own.multiple)


@dataclass(frozen=True, slots=True)
class Rollout:
    """What a `rollout_func` does with one batch of prompts: its `generate` calls in order, the longest prompt ids it
    returns, and its longest returned completion ids with the shortest and with the longest completions."""

    calls: tuple[RolloutCall, ...]
    prompt: int
    shortest_completion: int
    longest_completion: int

    def completion_buckets(self, multiple: int | None) -> tuple[int, ...]:
        return _spanned(self.shortest_completion, self.longest_completion, multiple)


def _spanned(low: int, high: int, multiple: int | None) -> tuple[int, ...]:
    """Every padded length of a length from `low` to `high`."""
    if multiple is None:
        return tuple(range(low, high + 1))
    return tuple(range(round_up(low, multiple), round_up(high, multiple) + 1, multiple))


Rollouts = Callable[[str, Sequence[int]], Rollout]  # (side: "train" / "eval", prompt indices) -> its Rollout


def completion_buckets(max_new_tokens: int, multiple: int | None) -> tuple[int, ...]:
    """Every padded completion length C a round can produce: R(L) for L in 1..max_new_tokens."""
    return _spanned(1, max_new_tokens, multiple)


PINNED = 2**62  # the cache length of every call of a run whose pin (`GenerationLayout.pin_cache`) is not yet known


class CacheLength:
    """The static cache length of successive `generate` calls on one model instance.

    transformers sizes the cache max(P + max_new_tokens - 1, max_cache_len, the previous call's length) and keeps
    the result on the model, so it only grows. None for a dynamic cache. After tool turns the previous length is
    one of several: each call's is then the set of lengths it can have. Where the layout pins the cache at the
    longest length the run needs (`pin_cache`), that length is known only once every call is seen: each call has
    `PINNED` until `plan_generation` puts it in, and `needed` / `first_needed` keep what the calls asked for.
    """

    def __init__(self, layout: GenerationLayout) -> None:
        self._layout = layout
        self._possible: frozenset[int] = frozenset({-1})
        self.needed = -1  # the longest P + max_new_tokens - 1 of the calls so far
        self.first_needed: int | None = None  # that of the first call
        self.own_calls = False  # a rollout function called the model's `generate` itself, which no pin reaches

    def _after(self, prompt_bucket: int, own: OwnGenerate | None) -> frozenset[int]:
        new, pin = (self._layout.max_new_tokens, self._layout.max_cache_len) if own is None \
            else (own.max_new_tokens, own.max_cache_len)
        self.own_calls |= own is not None
        if own is None and self._layout.pin_cache:
            self.needed = max(self.needed, prompt_bucket + new - 1)
            if self.first_needed is None:
                self.first_needed = self.needed
            pin = PINNED
        return frozenset(max(prompt_bucket + new - 1, -1 if pin is None else pin, p) for p in self._possible)

    def _static(self, own: OwnGenerate | None) -> bool:
        return self._layout.static_cache if own is None else own.static_cache

    def next(self, prompt_bucket: int, own: OwnGenerate | None = None) -> tuple[int | None, ...]:
        """The lengths a call at `prompt_bucket` can have (one, unless tool turns came before); `own`: a rollout
        function's call of the model's `generate` with its own settings (a dynamic cache leaves the length as it
        is)."""
        if not self._static(own):
            return (None,)
        self._possible = self._after(prompt_bucket, own)
        return tuple(sorted(self._possible))

    def turns(self, prompt_buckets: Sequence[int], own: OwnGenerate | None = None) -> dict[int, tuple[int | None, ...]]:
        """Tool turns that may run at any of `prompt_buckets`, or not at all: the lengths each bucket's call can
        have. The lengths any number of turns can leave are those one can (each is a running maximum)."""
        if not self._static(own):
            return {bucket: (None,) for bucket in prompt_buckets}
        each = {bucket: self._after(bucket, own) for bucket in prompt_buckets}
        self._possible = self._possible.union(*each.values())
        return {bucket: tuple(sorted(lengths)) for bucket, lengths in each.items()}


def _chunks(rows: Sequence[int], size: int) -> list[Sequence[int]]:
    """The rows of TRL's chunked no-grad forwards (`_get_per_token_logps_and_entropies(batch_size=size)`)."""
    return [rows[start:start + size] for start in range(0, len(rows), size)]


def _vision(images: Rows | None, rows: Sequence[int], *, shuffled: bool = False) -> BatchImages:
    """What a batch of these prompts' rows feeds the vision tower (nothing without images); `shuffled`: the keys in
    sorted order, the key of every order a shuffle of the rows gives."""
    return NO_IMAGES if images is None else images.vision(rows, shuffled=shuffled)


def _slices(images: Rows | None, batch: Sequence[int], rows: int) -> tuple[BatchImages, ...]:
    """What a micro-batch the trainer cuts from a round can feed the vision tower: it shuffles the round's rows (the
    global RNG) and trains on slices of `rows`, so any `rows` of them (one batch, keys sorted, where the slice is the
    whole round or every choice holds the same images)."""
    if images is None or images.images is None or rows == len(batch):
        return (_vision(images, batch[:rows], shuffled=True),)
    kinds: dict[tuple[object, ...], list[int]] = {}  # rows whose images are alike are interchangeable
    for row in batch:
        kinds.setdefault(tuple(images.images[row]), []).append(row)
    groups = list(kinds.values())
    out: dict[BatchImages, None] = {}

    def choose(group: int, left: int, chosen: list[int]) -> None:
        if group == len(groups):
            if left == 0:
                out[_vision(images, chosen, shuffled=True)] = None
            return
        for taken in range(min(left, len(groups[group])) + 1):
            choose(group + 1, left - taken, chosen + groups[group][:taken])

    choose(0, rows, [])
    return tuple(out)


@dataclass
class _Rank:
    cache: CacheLength
    prompt_bucket: int = 0  # P of the round being trained on
    train_rows: int = 0  # rows of each slice of the round being trained on
    train_vision: tuple[BatchImages, ...] = (NO_IMAGES,)  # the pixel batches a slice of the round can have
    completions: tuple[int, ...] | None = None  # the round's completion buckets, where a rollout function sets them


class _Counting:
    """Adds rounds and eval batches to a `ShapeCounter`, with the completion buckets."""

    def __init__(self, counter: ShapeCounter, layout: GenerationLayout) -> None:
        self.counter = counter
        self.layout = layout
        self.buckets = completion_buckets(layout.max_new_tokens, layout.pad_to_multiple_of)
        self.unpadded_calls = False  # a rollout function's own generate calls pass prompts padded to their longest

    def forwards(self, phase: Phase, rows: int, prompt_bucket: int, step: int, vision: BatchImages = NO_IMAGES,
                 buckets: Sequence[int] | None = None, *, alone: bool = True) -> None:
        """The forwards over a round's completions: one per completion bucket (`buckets`, default every one
        max_new_tokens can give); `alone`: the forward's images are these, not one of several it can have."""
        buckets = self.buckets if buckets is None else buckets
        for completion in buckets:
            self.counter.add(phase, rows, prompt_bucket + completion, step, certain=len(buckets) == 1 and alone,
                             logits_to_keep=completion, vision=vision)

    def generate(self, phase: Phase, rows: int, prompt_bucket: int, cache: CacheLength, step: int,
                 vision: BatchImages = NO_IMAGES, own: OwnGenerate | None = None) -> None:
        lengths = cache.next(prompt_bucket, own)
        new = self.layout.max_new_tokens if own is None else own.max_new_tokens
        for cache_len in lengths:
            self.counter.add(phase, rows, prompt_bucket, step, cache_len=cache_len, certain=len(lengths) == 1,
                             max_new_tokens=new, vision=vision)

    def rollout(self, phase: Phase, rollout: Rollout, cache: CacheLength, step: int) -> None:
        """A rollout function's `generate` calls: the first at its one bucket (certain), each later one at any
        bucket it can reach (met once), and every cache length those can grow."""
        for index, call in enumerate(rollout.calls):
            buckets = call.buckets(self.layout.pad_to_multiple_of)
            if index == 0 and len(buckets) == 1:
                self.generate(phase, call.rows, buckets[0], cache, step, own=call.own)
                continue
            self.unpadded_calls |= call.own is not None and call.own.multiple is None and len(buckets) > 1
            new = self.layout.max_new_tokens if call.own is None else call.own.max_new_tokens
            for bucket, lengths in cache.turns(buckets, call.own).items():
                for cache_len in lengths:
                    self.counter.add(phase, call.rows, bucket, step, cache_len=cache_len, certain=False,
                                     max_new_tokens=new)

    def tool_turns(self, phase: Phase, rows: int, prompt_lengths: Sequence[int], cache: CacheLength,
                   step: int) -> None:
        """The bound of the tool loop's `generate` calls after a first one on `rows` prompts of these lengths:
        each (k rows, bucket, cache length) a turn can meet, counted once per turn that can meet it."""
        loop = self.layout.tool_loop
        if loop is None or loop.turns == 0:
            return
        reach = loop.reach(prompt_lengths, self.layout.pad_to_multiple_of)
        if not reach:
            return
        # turn 1 starts from the cache the round's first generate left; a later turn from any an earlier turn left
        # (the cache then holds every length a turn can leave: each is a running maximum, so it grows no further)
        first = cache.turns(list(reach))
        # with one row there is no other to go on when the row that set a bucket leaves: its turns only grow
        later = cache.turns(list(reach)) if rows > 1 else first
        for bucket, turns in reach.items():
            for batch in (rows,) if loop.padded else range(1, rows + 1):
                most = turns[0] if loop.padded else turns[batch - 1]  # the turns that can meet it on these rows
                if most < 1:
                    continue
                for cache_len in sorted(set(first[bucket]) | set(later[bucket]), key=lambda n: n or 0):
                    count = (cache_len in first[bucket]) + (cache_len in later[bucket]) * (most - 1)
                    if count:
                        self.counter.add(phase, batch, bucket, step, count=count, cache_len=cache_len, certain=False,
                                         max_new_tokens=self.layout.max_new_tokens)


def plan_generation(
    *,
    method: Method,
    prompt_lengths: Sequence[int],
    layout: GenerationLayout,
    loop: TrainLoop,
    epoch_batches: Callable[[int], RankBatches],
    eval_prompt_lengths: Sequence[int] = (),
    eval_batches: RankBatches = (),
    eval_steps: Sequence[int] = (),
    images: Rows | None = None,
    eval_images: Rows | None = None,
    rollouts: Rollouts | None = None,
    exact: bool = True,
    generation_kwargs: Mapping[str, object] | None = None,
    config: dict[str, object] | None = None,
    versions: dict[str, str] | None = None,
    fingerprint: dict[str, str] | None = None,
    warnings: Sequence[str] = (),
) -> Plan:
    """Replay the training loop rank by rank, in time order (the cache length depends on it), into a Plan.
    `images` / `eval_images`: the prompts' image grids, by prompt index (vision-language runs); `rollouts`: what a
    rollout function does with a batch of prompts, where one makes the rounds."""
    counting = _Counting(ShapeCounter(), layout)
    multiple = layout.pad_to_multiple_of
    ranks: list[_Rank] | None = None
    pending_evals = sorted(eval_steps)
    micro = tokens = padded = 0
    last_step = 0
    micro_step = 0  # TRL's `_step`: micro-batches trained so far, across epochs
    evaluations = 0

    def run_evals(before: int) -> None:
        nonlocal evaluations
        while pending_evals and pending_evals[0] < before:
            step = pending_evals.pop(0)
            evaluations += 1
            for rank_state, rank_batches in zip(ranks or [], eval_batches, strict=False):
                for batch in rank_batches:
                    lengths = [eval_prompt_lengths[i] for i in batch]
                    if rollouts is not None:
                        rollout = rollouts("eval", batch)
                        counting.rollout("eval_generate", rollout, rank_state.cache, step)
                        bucket, completions = round_up(rollout.prompt, multiple), rollout.completion_buckets(multiple)
                    else:
                        bucket, completions = round_up(max(lengths), multiple), None
                        counting.generate("eval_generate", len(batch), bucket, rank_state.cache, step,
                                          _vision(eval_images, batch))
                        counting.tool_turns("eval_generate", len(batch), lengths, rank_state.cache, step)
                    for phase in layout.eval_forwards:
                        for rows in _chunks(batch, layout.eval_batch_size):
                            counting.forwards(phase, len(rows), bucket, step, _vision(eval_images, rows),
                                              completions)

    current_epoch, batches = -1, None
    for mb in micro_batches(loop):
        if mb.epoch != current_epoch:
            current_epoch, batches = mb.epoch, epoch_batches(mb.epoch)
        assert batches is not None
        if ranks is None:
            ranks = [_Rank(CacheLength(layout)) for _ in batches]
        run_evals(mb.step)  # the evals after earlier steps (0: eval_on_start)
        generating = micro_step % layout.generate_every == 0
        for rank_state, rank_batches in zip(ranks, batches, strict=False):
            if mb.index >= len(rank_batches):
                continue
            if generating:
                batch = rank_batches[mb.index]
                lengths = [prompt_lengths[i] for i in batch]
                rank_state.train_rows = len(batch) // layout.steps_per_generation
                rank_state.train_vision = _slices(images, batch, rank_state.train_rows)
                if rollouts is not None:
                    rollout = rollouts("train", batch)
                    counting.rollout("generate", rollout, rank_state.cache, mb.step)
                    bucket = round_up(rollout.prompt, multiple)
                    rank_state.completions = rollout.completion_buckets(multiple)
                else:
                    bucket = round_up(max(lengths), multiple)
                    counting.generate("generate", len(batch), bucket, rank_state.cache, mb.step,
                                      _vision(images, batch))
                    counting.tool_turns("generate", len(batch), lengths, rank_state.cache, mb.step)
                rank_state.prompt_bucket = bucket
                for phase in layout.round_forwards:
                    for rows in _chunks(batch, layout.batch_size):
                        counting.forwards(phase, len(rows), bucket, mb.step, _vision(images, rows),
                                          rank_state.completions)
                tokens += sum(lengths)
                padded += len(batch) * bucket
            for vision in rank_state.train_vision:
                counting.forwards("train", rank_state.train_rows, rank_state.prompt_bucket, mb.step, vision,
                                  rank_state.completions, alone=len(rank_state.train_vision) == 1)
            micro += 1
        micro_step += 1
        last_step = mb.step
    if ranks is None:
        ranks = [_Rank(CacheLength(layout)) for _ in eval_batches]
    run_evals(last_step + 1)

    if layout.pin_cache and any(rank.cache.own_calls for rank in ranks):
        # the pin is set on the trainer's generation config, which a call of the model's own `generate` need not
        # read: the run is planned as it runs, unpinned
        return plan_generation(
            method=method, prompt_lengths=prompt_lengths, layout=dataclasses.replace(layout, pin_cache=False),
            loop=loop, epoch_batches=epoch_batches, eval_prompt_lengths=eval_prompt_lengths,
            eval_batches=eval_batches, eval_steps=eval_steps, images=images, eval_images=eval_images,
            rollouts=rollouts, exact=exact, generation_kwargs=generation_kwargs, config=config, versions=versions,
            fingerprint=fingerprint, warnings=warnings)
    shapes = counting.counter.shapes()
    config = dict(config or {})
    if layout.pin_cache and layout.static_cache:
        shapes = _pinned(shapes, [rank.cache for rank in ranks], config)
    pinned = config.get("pin_cache")
    all_warnings = list(warnings) + _generation_warnings(shapes, layout, generation_kwargs or {},
                                                         pinned if isinstance(pinned, int) else None)
    if counting.unpadded_calls:
        generates = sum(s.phase in GENERATE_PHASES for s in shapes)
        all_warnings.append(f"the rollout function's own generate calls pass prompts padded to their longest row, so "
                            f"every length is a generate shape of its own ({generates} generate entries); pad them to "
                            "a multiple (the tokenizer's pad_to_multiple_of=128)")
    return Plan(
        method=method,
        exact=exact,
        pad_to_multiple_of=multiple,
        shapes=shapes,
        stats=PlanStats(rows=len(prompt_lengths), dropped_rows=0, micro_batches=micro, optimizer_steps=last_step,
                        tokens=tokens, padded_tokens=padded, evaluations=evaluations,
                        eval_rows=len(eval_prompt_lengths) if evaluations else 0),
        config=config,
        versions=dict(versions or {}),
        fingerprint=dict(fingerprint or {}),
        warnings=tuple(all_warnings),
    )


def _pinned(shapes: Sequence[Shape], caches: Sequence[CacheLength], config: dict[str, object]) -> tuple[Shape, ...]:
    """The shapes of a run that pins its cache at the longest length its calls need (`GenerationLayout.pin_cache`):
    each call's placeholder length made that one. The pin is recorded (`config["pin_cache"]`) where it changes the
    run: where a call would have another length, unpinned (some rank's first call needs less than the longest, so
    its running maximum starts lower)."""
    pin = max((cache.needed for cache in caches), default=-1)
    if pin < 0:
        return tuple(shapes)
    if any(cache.first_needed not in (None, pin) for cache in caches):
        config["pin_cache"] = pin
    return tuple(dataclasses.replace(s, cache_len=pin) if s.cache_len == PINNED else s for s in shapes)


def pinned_cache(plan: Plan) -> int | None:
    """The one cache length a plan of a pinned run has every `generate` at (its `pin_cache`), or None."""
    pin = plan.config.get("pin_cache")
    return pin if isinstance(pin, int) else None


def pin_kwargs(generation_kwargs: Mapping[str, object], max_cache_len: int) -> str:
    """The `--generation_kwargs` value that pins the static cache at `max_cache_len`, the run's own kwargs kept."""
    return json.dumps({**generation_kwargs, "max_cache_len": max_cache_len})


@dataclass(frozen=True, slots=True)
class CachePin:
    """What pinning the static cache length would change: the value to pin and the generate graphs it saves."""

    max_cache_len: int
    graphs: int  # distinct generate graphs as planned
    pinned_graphs: int  # distinct generate graphs with the cache length pinned

    @property
    def saved(self) -> int:
        return self.graphs - self.pinned_graphs


def cache_pin(shapes: Sequence[Shape]) -> CachePin | None:
    """The pin that makes every static-cache `generate` use one cache length, when the run meets several."""
    generate = [s for s in shapes if s.phase in GENERATE_PHASES and s.cache_len is not None]
    lengths = {s.cache_len for s in generate}
    if len(lengths) < 2:
        return None
    longest = max(s.cache_len for s in generate if s.cache_len is not None)
    pinned = {(s.phase, s.batch, s.seq, s.max_new_tokens) for s in generate}
    return CachePin(max_cache_len=longest, graphs=len({s.key for s in generate}), pinned_graphs=len(pinned))


def _generation_warnings(shapes: Sequence[Shape], layout: GenerationLayout, generation_kwargs: Mapping[str, object],
                         pinned: int | None) -> list[str]:
    """`pinned`: the cache length the plan pins the run at (its `pin_cache`), where it pins one."""
    out: list[str] = []
    if not layout.static_cache:
        out.append(f"generation uses a dynamic cache: every decode step meets a new key/value length (P+1 .. "
                   f"P+{layout.max_new_tokens - 1} for each generate entry), a compile each on Neuron; pass "
                   "--cache_implementation static")
    pin = cache_pin(shapes)
    if pin is not None:
        lengths = sorted({s.cache_len for s in shapes if s.phase in GENERATE_PHASES and s.cache_len is not None})
        out.append(f"the static cache length grows during the run ({', '.join(map(str, lengths))}: the running "
                   f"maximum of P + max_new_tokens - 1), so generate compiles {pin.graphs} graphs where "
                   f"{pin.pinned_graphs} would do; pin it with --generation_kwargs "
                   f"'{pin_kwargs(generation_kwargs, pin.max_cache_len)}'")
    padded = layout.tool_loop is not None and layout.tool_loop.padded
    what, how, off = [], [], []  # what the run must do as the plan has it
    if padded:
        what.append("its tool turns padded to the round's rows")
        how.append("call shapeplan.pad_tool_turns(trainer)")
        off.append("--pad_tool_turns false")
    if pinned is not None:
        what.append(f"its static cache pinned at {pinned} tokens, the longest any generate call needs (unpinned, the "
                    "cache length is a running maximum, so later calls can meet each bucket at several lengths)")
        how.append(f"pass --generation_kwargs '{pin_kwargs(generation_kwargs, pinned)}' (in a script, its config's "
                   "generation_kwargs)")
        off.append("--pin_cache false")
    if what:
        out.append(f"the plan is of a run with {' and '.join(what)}, which the run must do too: run it under "
                   f"`shapeplan guard` (or a ShapeGuard holding the plan), or {' and '.join(how)}; {' / '.join(off)} "
                   "plans it otherwise")
    if layout.tool_loop is not None and not padded:
        generate = [s for s in shapes if s.phase in GENERATE_PHASES]
        rows = len({(s.phase, s.seq, s.cache_len) for s in generate})
        if len(generate) > rows:
            out.append(f"tool turns generate on the rows that called a tool, any number of a round's rows, each a "
                       f"graph of its own: {len(generate)} generate entries where about {rows} would do padded to "
                       "the round's rows (--pad_tool_turns true, the default with tools, and the run under "
                       "`shapeplan guard` or after shapeplan.pad_tool_turns(trainer))")
    if layout.pad_to_multiple_of is None:
        out.append(f"pad_to_multiple_of is none: every completion length 1..{layout.max_new_tokens} is a shape of "
                   "its own; pass --pad_to_multiple_of 128")
    return out

