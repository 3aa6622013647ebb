"""The rounds of the generation warm-up (GRPO, RLOO, Distillation), planned without torch: one task per planned
`generate` size, each a list of rounds of `_generate` calls (see shapeplan/warm/generation.py), and the lockstep
that keeps the ranks of a multi-process warm-up stepping together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PlanFileError
from ..plan.buckets import round_up
from ..plan.model import Phase, Plan

# The phase of a task's `generate` call -> the phase of the forwards its rounds run, by side (train, eval loop).
_GENERATE: Phase = "generate"
_EVAL_GENERATE: Phase = "eval_generate"
# Phases the rounds of a generate task run (GRPO, RLOO): on the train side, and in the eval loop.
ROUND_PHASES: tuple[Phase, ...] = ("train", "old_logprob", "ref")
EVAL_ROUND_PHASES: tuple[Phase, ...] = ("eval",)


@dataclass(frozen=True, slots=True)
class GenerateTask:
    """A planned generate size, and the completion buckets whose forwards and train step its rounds run."""

    phase: str
    batch: int  # rows of one generation batch
    seq: int  # prompt bucket P
    cache_len: int | None
    max_new_tokens: int
    completions: tuple[int, ...] = ()  # C buckets trained with this task (empty: an earlier task of this P has)
    sliding_window: int | None = None  # the model's sliding layers' window (their static cache: the lesser of two)
    turn: bool = False  # a tool turn: the tool loop's `generate` on the rows that called a tool, no round of its own

    @property
    def key(self) -> str:
        parts = [self.phase, f"{self.batch}x{self.seq}", f"cache={self.cache_len}", f"new={self.max_new_tokens}"]
        if self.completions:
            parts.append(f"C={','.join(map(str, self.completions))}")
        if self.turn:
            parts.append("turn")
        return " ".join(parts)

    @property
    def label(self) -> str:
        """Its size with its cache length (and the sliding layers' when the model has them) and new tokens:
        generate sizes of one (batch, prompt) differ in them."""
        cache = "dynamic cache" if self.cache_len is None else f"cache {self.cache_len}"
        if self.sliding_window is not None and self.cache_len is not None:
            cache += f", sliding {min(self.sliding_window, self.cache_len)}"
        turn = " turn" if self.turn else ""
        return f"{self.phase}{turn} ({self.batch}, {self.seq}, {cache}, new {self.max_new_tokens})"

    @property
    def cost(self) -> float:
        """Estimated compile minutes (plan/cost.py's rates): the generate graphs and one train shape per C."""
        from ..plan.cost import GENERATE_SHAPE_MINUTES, TRAIN_SHAPE_MINUTES

        return GENERATE_SHAPE_MINUTES + TRAIN_SHAPE_MINUTES * len(self.completions)


def generation_tasks(plan: Plan, round_phases: tuple[str, ...] = ROUND_PHASES,
                     eval_round_phases: tuple[str, ...] = EVAL_ROUND_PHASES) -> tuple[GenerateTask, ...]:
    """One task per planned generate size, in plan order, the train side's then the eval loop's; `round_phases` /
    `eval_round_phases`: the forwards of a round on each side."""
    unsupported = sorted({s.phase for s in plan.shapes} - {_GENERATE, _EVAL_GENERATE} - set(round_phases)
                         - set(eval_round_phases))
    if unsupported:
        raise PlanFileError(f"the plan has {', '.join(unsupported)} shapes, which a {plan.method} run does not meet; "
                            "re-create the plan with `shapeplan analyze`")
    return (*_side_tasks(plan, _GENERATE, round_phases), *_side_tasks(plan, _EVAL_GENERATE, eval_round_phases))


def _side_tasks(plan: Plan, generate_phase: Phase, round_phases: tuple[str, ...]) -> list[GenerateTask]:
    completions: dict[int, set[int]] = {}
    for shape in plan.shapes:
        if shape.phase in round_phases and shape.logits_to_keep is not None:
            completions.setdefault(shape.seq - shape.logits_to_keep, set()).add(shape.logits_to_keep)
    generates = plan.by_phase(generate_phase)
    rounds = {s.batch for s in generates if s.certain}  # generation batches: a round's own generate is certain
    if not rounds and generates:
        # every generate of the side uncertain (the eval loop's, after tool turns or a rollout function may have
        # grown the cache in training): its rounds are the generation batch's, the side's largest
        rounds = {max(s.batch for s in generates)}
    tasks, trained = [], set()
    for shape in generates:
        assert shape.max_new_tokens is not None
        # a possible generate (GRPO's tool loop) that no round can make is a tool turn
        turn = not shape.certain and not (shape.batch in rounds and shape.seq in completions)
        buckets = () if turn or shape.seq in trained else tuple(sorted(completions.get(shape.seq, ())))
        if not turn:
            trained.add(shape.seq)
        tasks.append(GenerateTask(phase=shape.phase, batch=shape.batch, seq=shape.seq, cache_len=shape.cache_len,
                                  max_new_tokens=shape.max_new_tokens, completions=buckets,
                                  sliding_window=plan.config.get("sliding_window"), turn=turn))
    return tasks


# -- what each round does -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """One `trainer._generate` call: B prompts of bucket P; `length` None runs the model's own `generate` (decoded
    to max_new_tokens), else `generate` returns `length` tokens per row, the first `eos_rows` rows ending in EOS.

    `unpadded`: every prompt is P tokens long (else the batch is padded on the left); `short`: every row but the
    first ends at its first token (completions of mixed lengths, so the completion mask has padding).
    `gathered`: `eos_rows` counts the rows of every rank's call together, filled rank by rank (rank r's first
    `eos_rows - r * rows` rows, clamped to 0..rows): the trainers select the EOS-terminated lengths out of the ranks'
    gathered completion lengths, a selection whose size is that total.
    """

    rows: int
    prompt: int
    length: int | None = None
    eos_rows: int = 0
    unpadded: bool = False
    short: bool = False
    cache_len: int | None = None  # the static cache length the model's own generate must use
    gathered: bool = False

    def eos_rows_of(self, rank: int) -> int:
        """The rows of `rank`'s call that end in EOS."""
        return min(max(self.eos_rows - rank * self.rows, 0), self.rows) if self.gathered else self.eos_rows


@dataclass(frozen=True, slots=True)
class Round:
    """One generation round: `before` calls (post-processing of every generated length), then the round's own."""

    task: GenerateTask | None  # None: a round that repeats warmed work (rank padding)
    own: Call
    before: tuple[Call, ...] = ()
    last: bool = False  # the task's last round
    turns: tuple[tuple[GenerateTask, Call], ...] = ()  # tool turns run in this round, each finishing its task


def completion_length(bucket: int, max_new_tokens: int, multiple: int | None) -> int:
    """A generated length L with R(L) == bucket."""
    length = min(bucket, max_new_tokens)
    if round_up(length, multiple) != bucket:
        raise PlanFileError(f"completion bucket {bucket} cannot come from at most {max_new_tokens} new tokens; "
                            "re-create the plan with `shapeplan analyze ... -o PLAN`")
    return length


def prompt_layouts(rows: int, generations: int, multiple: int | None) -> tuple[bool, ...]:
    """Whether a generation batch's prompts arrive padded (False) or not (True), as far as the plan can tell.

    A batch whose rows repeat one prompt has no left padding when that prompt's length is a multiple of the padding
    multiple (always, without one); then a batch of full-length completions has no padding at all and attention
    skips its mask (other ops). Batches of several prompts are taken to be padded (equal lengths are unlikely).
    """
    if rows > generations:
        return (False,)
    return (True,) if multiple in (None, 1) else (False, True)


def turn_calls(task: GenerateTask, multiple: int | None) -> tuple[Call, ...]:
    """The calls of a tool-turn task, each a `_generate_single_turn` as the tool loop makes it: the model's own
    `generate` (its rows are different sequences, so padded on the left, unless it has one row, which a padding
    multiple leaves unpadded when its length is one, and no multiple always); then the post-processing of every
    length it can return, as `task_rounds`' calls before a round (L < max_new_tokens: every row ended in EOS;
    L = max_new_tokens: 0..k rows did)."""
    b, p, new = task.batch, task.seq, task.max_new_tokens
    if b > 1:
        layouts: tuple[bool, ...] = (False,)
    else:
        layouts = (True,) if multiple in (None, 1) else (False, True)
    calls = [Call(b, p, unpadded=u, cache_len=task.cache_len) for u in layouts]
    calls += [Call(b, p, length, b) for length in range(1, new)]
    calls += [Call(b, p, new, k) for k in range(b + 1)]
    return tuple(calls)


def task_rounds(task: GenerateTask, multiple: int | None, layouts: tuple[bool, ...] = (False,),
                ranks: int = 1, rollout: bool = False) -> list[Round]:
    """The rounds of `task`, for each prompt layout, on one of `ranks` ranks stepping together: full-length
    completions with every count of EOS rows on this rank (0..B) and, together with the other ranks' calls, in the
    gathered batch (0..ranks * B). `rollout`: the completions trained on are a rollout function's, which joins
    several calls' and its own tokens, so a bucket past what one call generates is returned whole."""
    b, p, new = task.batch, task.seq, task.max_new_tokens
    before = [Call(b, p, length, b, unpadded=layouts[0]) for length in range(1, new)]
    before += [Call(b, p, new, k, unpadded=layouts[0], gathered=ranks > 1) for k in range(ranks * b + 1)]
    rounds = [Round(task, Call(b, p, unpadded=u, cache_len=task.cache_len), tuple(before) if i == 0 else ())
              for i, u in enumerate(layouts)]
    for bucket in task.completions:
        longer = rollout and round_up(min(bucket, new), multiple) != bucket
        length = bucket if longer else completion_length(bucket, new, multiple)
        eos_rows = b if length < new else 0
        for unpadded in layouts:
            rounds.append(Round(task, Call(b, p, length, eos_rows, unpadded=unpadded)))
            if unpadded and length > 1:
                rounds.append(Round(task, Call(b, p, length, eos_rows, unpadded=True, short=True)))
    return [Round(r.task, r.own, r.before, last=i == len(rounds) - 1) for i, r in enumerate(rounds)]


def lockstep(shares: Sequence[Sequence[Round]]) -> list[list[Round]]:
    """Pad every rank's rounds to the same count, and each round's calls to the same count, with repeats of warmed
    work (a rank with nothing to warm repeats another rank's last round). A padding call mirrors the other ranks'
    call it runs with (its length, its share of the gathered EOS rows), on the rank's own batch size and prompt,
    so that gathered counts add up as planned."""
    count = max(len(s) for s in shares)
    first = next(s for s in shares if s)
    out = []
    for rounds in shares:
        filler = (rounds or first)[-1].own
        out.append(list(rounds) + [Round(None, Call(filler.rows, filler.prompt, filler.length or 1, filler.rows))
                                   for _ in range(count - len(rounds))])
    for i in range(count):
        calls = max((r[i].before for r in out), key=len)
        for r in out:
            own, before = r[i].own, r[i].before
            spares = tuple(Call(own.rows, own.prompt, c.length or 1, c.eos_rows if c.gathered else own.rows,
                                gathered=c.gathered) for c in calls[len(before):])
            r[i] = Round(r[i].task, own, before + spares, r[i].last)
    return out
