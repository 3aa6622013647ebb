"""The DPO, KTO and Reward warmers: the real trainers, built as `trl dpo|kto|reward` build them, train on synthetic
prepared rows through `Trainer.train()`, with the trainer-loop warm-up (shapeplan/warm/trainer_loop.py: fixed
batches, per-shape accounting, the eval pass carried by `eval_on_start`).

The DPO and Reward collators stack a batch's chosen sequences, then its rejected ones, and pad them together: a
planned `(2B, seq)` shape is `B` rows whose 2B sequence lengths are a synthetic layout of that shape. DPO's step
runs the policy and the reference model on the same tensors, so a planned `ref` (`eval_ref`) shape is warmed by
the `train` (`eval`) task of the same shape. DPO's metrics select the completion tokens of each half of the batch
with a boolean mask, so every planned completion-token count gets a batch whose chosen (or rejected) half has that
many; KTO's (see `KTOWarmer`) likewise, with its desirable-row counts. Not warmed yet: Reward's optional `margin`
column.

With `precompute_ref_log_probs`, DPO and KTO compute the reference log-probs in one pass over the data before training
(`_precompute_ref_logps`, run by the trainer's `__init__`); the train step then reads them from the batch. The
warm-up runs that same method once per layout of each planned `ref_precompute` shape, each on a dataset of that one
batch at the pass's batch size: a full batch, or the pass's short last one (whose gathered log-probs accelerate cuts
to the remainder). Under `accelerate launch` the ranks run the passes together, as the run does: each pass's dataset
holds one batch per rank, which accelerate's sharding hands to that rank, and a rank with fewer passes of its own
repeats planned ones. The first train-side and eval-side passes are the datasets the trainer is built with, so
`__init__` runs them as in the run; the synthetic training rows then carry placeholder reference log-probs.
"""

from __future__ import annotations

import os
import tempfile
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from ..errors import PlanFileError
from ..plan.model import Phase, Plan
from .model import WarmTask
from .runner import WARMED_PHASES
from .synthetic import SyntheticBatch, padded_batches, token_ids
from .tracker import Tracker
from .trainer_loop import TrainerLoopWarmer

_PRECOMPUTE: Phase = "ref_precompute"


@dataclass(frozen=True, slots=True)
class PairedBatch:
    """The rows of one synthetic batch: (prompt, chosen completion, rejected completion) token counts each (KTO:
    (prompt, completion, KL completion, desirable))."""

    rows: tuple[tuple[int, ...], ...]


def paired_layouts(batch: SyntheticBatch) -> PairedBatch:
    """A layout of 2B sequence lengths as B rows: the first B are the chosen sides, the last B the rejected, each
    after a one-token prompt."""
    half = len(batch.documents) // 2
    chosen, rejected = batch.documents[:half], batch.documents[half:]
    return PairedBatch(tuple((1, c - 1, r - 1) for c, r in zip(chosen, rejected, strict=False)))


def counted_batch(rows: int, longest: int, chosen: int, rejected: int) -> PairedBatch | None:
    """B rows whose chosen halves hold `chosen` completion tokens and rejected halves `rejected`, none longer than
    `longest` and one exactly that long; None when they do not fit."""
    room = longest - 1  # a one-token prompt at least
    if max(chosen, rejected) > rows * room:
        return None

    def fill(total: int) -> list[int]:
        out = []
        for _ in range(rows):
            out.append(min(room, total))
            total -= out[-1]
        return out

    chosen_rows, rejected_rows = fill(chosen), fill(rejected)
    # the first row's prompt makes its longer side `longest` (the others keep a one-token prompt)
    first = (longest - max(chosen_rows[0], rejected_rows[0]), chosen_rows[0], rejected_rows[0])
    return PairedBatch((first, *((1, c, r) for c, r in zip(chosen_rows[1:], rejected_rows[1:], strict=True))))


@dataclass(frozen=True, slots=True)
class _Pass:
    """One precompute pass: the batch `layout` at the pass's `batch_size`, charged to `task` (None: a repeat)."""

    task: WarmTask | None
    name: str  # "train" or "eval": the trainer's name for the pass
    batch_size: int
    layout: PairedBatch


@dataclass(frozen=True, slots=True)
class _Round:
    """One pass all ranks run together, each on its own batch (`ranks[r]`); with `cut`, the pass is the first `cut`
    rows of those batches, charged to no task: a short last batch that accelerate completes with rows from the start
    and whose gathered log-probs it cuts to `cut` rows, as at the end of the run's pass."""

    name: str
    batch_size: int
    ranks: tuple[_Pass, ...]
    cut: int = 0


def shared_datasets(rows: Sequence[list[dict[str, Any]]]) -> list[Any]:
    """A dataset of each `rows`, the same files on every rank: the main process writes them into a new folder.

    TRL's precompute pass caches its result next to the dataset's files, under a fingerprint from rank 0 that every
    rank then reads back, so the ranks need one dataset on disk (as a real run's loaded dataset is), not one in
    memory each (whose cache file is a new temp name per process). The folder lives in the datasets cache
    (`HF_DATASETS_CACHE`), where the real run's precompute result lives too: on several nodes both work when that
    cache is shared. It is removed when the main process exits (or by this host's next warm-up if it is killed
    first; its name holds the host, so a warm-up never removes another host's folder).
    """
    import atexit
    import shutil
    import socket

    import datasets
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    from ..plan.io import remove_stale

    state = PartialState()
    folder = [""]
    if state.is_main_process:
        root = Path(datasets.config.HF_DATASETS_CACHE)
        root.mkdir(parents=True, exist_ok=True)
        prefix = f"shapeplan-precompute-{socket.gethostname()}-"
        remove_stale(root, prefix)
        folder[0] = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)
        atexit.register(shutil.rmtree, folder[0], True)
        for i, part in enumerate(rows):
            datasets.Dataset.from_list(part).save_to_disk(os.path.join(folder[0], str(i)))
    broadcast_object_list(folder, from_process=0)  # also waits for the main process's writes
    return [datasets.load_from_disk(os.path.join(folder[0], str(i))) for i in range(len(rows))]


def taking_prepared_rows(trainer: Any) -> Any:
    """A subclass of TRL's `trainer` that takes the synthetic rows as `_prepare_dataset`'s output (DPO and KTO have
    no option to skip their preparation)."""

    class Prepared(trainer):
        def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
            return dataset

    Prepared.__name__ = Prepared.__qualname__ = f"Prepared{trainer.__name__}"
    return Prepared


class _PreferenceWarmer(TrainerLoopWarmer[PairedBatch]):
    """What DPO and Reward share: paired rows, two sequences per row, no padding-free batches."""

    # TRL 1.16's preference collators always pad (DPO's padding_free falls back to padding): the base's
    # `_padding_free` (False) holds.
    rows_per_example = 2

    def layouts(self, task: WarmTask) -> list[PairedBatch]:
        """The task's padded layouts (with padding, and without where reachable), none longer than max_length:
        the plan's seq is at most R(max_length), so capping keeps the batch's length."""
        cap = self.config.max_length
        out = []
        for layout in padded_batches(task.batch, task.seq, self.config.pad_to_multiple_of, cap):
            lengths = tuple(min(n, cap) if cap is not None else n for n in layout.documents)
            out.append(paired_layouts(SyntheticBatch(lengths)))
        return out

    def _eval_batches(self, tasks: Sequence[WarmTask]) -> list[tuple[WarmTask, PairedBatch]]:
        """`per_pass` batches of each shape, its layouts in turn, and every layout at least once (KTO's desirable-row
        counts and KL lengths can ask for more batches than a pass has: the extra ones make another pass)."""
        out = []
        for task in tasks:
            layouts = self.layouts(task)
            out += [(task, layouts[i % len(layouts)]) for i in range(max(task.per_pass, len(layouts)))]
        return out

    def _short(self, task: WarmTask | None) -> bool:
        return task is not None and task.batch // self.rows_per_example == self.eval_short

    @abstractmethod
    def example(self, counts: tuple[int, ...], offset: int) -> dict[str, Any]:
        """One prepared dataset row with these token counts (a `PairedBatch` row)."""

    def rows(self, batches: Sequence[PairedBatch], *, ref_logps: bool = True
             ) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """The rows of `batches`; with `ref_logps`, a run that precomputes the reference log-probs has them in its
        rows (placeholders: the step only reads them)."""
        extra = dict.fromkeys(self.ref_columns, 0.0) if ref_logps and self._precomputes() else {}
        rows: list[dict[str, Any]] = []
        index: list[list[int]] = []
        for batch in batches:
            index.append(list(range(len(rows), len(rows) + len(batch.rows))))
            rows += [{**self.example(counts, offset=len(rows) + i), **extra} for i, counts in enumerate(batch.rows)]
        return rows, index

    # -- the reference precompute pass (DPO, KTO) --------------------------------------------------------------

    ref_columns: tuple[str, ...] = ()  # the columns the precompute pass adds to the dataset

    def _precomputes(self) -> bool:
        return bool(getattr(self.config, "precompute_ref_log_probs", False))

    def bind(self, plan: Plan) -> None:
        super().bind(plan)
        self._planned_rows = (plan.stats.rows, plan.stats.eval_rows)

    def run(self, tasks: Sequence[WarmTask], context: Sequence[WarmTask], tracker: Tracker) -> None:
        self._rounds = self._pass_rounds(tasks, context)
        self._tracker = tracker
        super().run(tasks, context, tracker)

    def _pass_sizes(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """The train and eval passes' names and a rank's batch of each: its share of the dataloader's batch under
        split_batches."""
        from ..adapters.loop import sharding

        share = sharding(self.args).rank_batch_size

        def size(option: str) -> int:  # precompute_ref_batch_size, else the loop's own batch size
            name = "precompute_ref_batch_size" if self.config.precompute_ref_batch_size else option
            return share(getattr(self.config, name), name)

        return ("train", size("per_device_train_batch_size")), ("eval", size("per_device_eval_batch_size"))

    def _precompute_passes(self, tasks: Sequence[WarmTask]) -> list[_Pass]:
        """One pass per layout of each task. A task whose rows are the train pass's batch size, or the train pass's
        remainder, is a train-side batch; else an eval-side one."""
        (_, train_size), (_, eval_size) = self._pass_sizes()
        out = []
        for task in tasks:
            rows = task.batch // self.rows_per_example
            train = rows in (train_size, self._planned_rows[0] % train_size)
            name, batch_size = ("train", train_size) if train else ("eval", eval_size)
            out += [_Pass(task, name, max(batch_size, rows), layout) for layout in self.layouts(task)]
        return out

    def _pass_rounds(self, tasks: Sequence[WarmTask], context: Sequence[WarmTask]) -> list[_Round]:
        """The passes all ranks run together, train-side first. In each, every rank's dataloader yields one batch:
        one of its own pending passes, or a repeat of planned work (charged to no task) where it has fewer. The
        trainer's `__init__` runs the first train-side round, so there is one even when none is pending."""
        if not self._precomputes():
            return []
        planned = self._precompute_passes([t for t in context if t.phase == _PRECOMPUTE])
        if not any(p.name == "train" for p in planned):
            raise PlanFileError("the plan has no train-side ref_precompute shape; re-create it with `shapeplan "
                                "analyze`")
        shares = self.shares if self.shares is not None else [list(tasks)]
        groups = sorted(dict.fromkeys((p.name, p.batch_size) for p in planned), key=lambda g: g[0] != "train")
        rounds: list[_Round] = []
        for name, batch_size in groups:
            of_group = [p for p in planned if (p.name, p.batch_size) == (name, batch_size)]
            own = [[p for p in of_group if p.task in share] for share in shares]
            count = max(max(map(len, own)), int(name == "train" and not rounds))
            for i in range(count):
                ranks = tuple(mine[i] if i < len(mine) else replace((mine or of_group)[-1], task=None)
                              for mine in own)
                rounds.append(_Round(name, batch_size, ranks))
        return rounds + self._cut_rounds(rounds)

    def _cut_rounds(self, rounds: list[_Round]) -> list[_Round]:
        """Under several ranks, a round for each pass whose rows leave a last gathered batch that accelerate cuts
        (the rows modulo every rank's batch together). In one process the pass's short last batch is a planned
        shape of its own, whose round cuts already."""
        ranks = self.args.num_processes
        if ranks == 1:
            return []
        out = []
        for (name, size), rows in zip(self._pass_sizes(), self._planned_rows, strict=True):
            source = next((r for r in rounds if r.batch_size == size), None)
            if rows % (size * ranks) and source is not None:
                out.append(replace(source, name=name, cut=rows % (size * ranks)))
        return out

    def _build_trainer(self, train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]] | None) -> Any:
        """Without a precompute pass, the base's trainer. With one, the trainer is built on the first train-side
        and eval-side rounds (its `__init__` runs the pass over them), then runs the other rounds."""
        if not self._precomputes():
            return super()._build_trainer(train_rows, eval_rows)
        from accelerate import PartialState

        rounds = self._rounds
        first = [next((i for i, r in enumerate(rounds) if r.name == name), None) for name in ("train", "eval")]
        initial = [i for i in first if i is not None]
        ordered = [rounds[i] for i in initial] + [r for i, r in enumerate(rounds) if i not in initial]
        rank = PartialState().process_index if self.shares is not None else 0
        self._queue = [None if r.cut else r.ranks[rank].task for r in ordered]
        # each round's dataset holds every rank's batch in rank order: accelerate's sharding of the pass's
        # dataloader gives each rank its own
        datasets = shared_datasets([self.rows([p.layout for p in r.ranks], ref_logps=False)[0][:r.cut or None]
                                    for r in ordered])
        trainer = self._new_trainer(datasets[0], datasets[1] if len(initial) > 1 else None)
        # the pass's dataloader batch: under split_batches the ranks' batches together, which accelerate splits
        together = self.args.num_processes if self.config.accelerator_config.split_batches else 1
        for r, dataset in zip(ordered[len(initial):], datasets[len(initial):], strict=True):
            trainer._precompute_ref_logps(dataset, r.name, r.batch_size * together)
        return trainer

    def _pass_begins(self) -> None:
        self._tracker.start()  # what ran before (loading the model, the previous pass's caching) is no task's

    def _pass_ends(self) -> None:
        task = self._queue.pop(0)
        if task is None or task in self._tracker.results:  # a repeat, or warmed by an earlier warm-up
            return
        if task in self._queue:
            self._tracker.charge(task)
        else:
            self._tracker.finish(task)

    def trainer_type(self) -> Any:
        trainer = super().trainer_type()
        if not self._precomputes():
            return trainer
        warmer = self

        class Precomputing(trainer):  # type: ignore[misc,valid-type]  # TRL's class, known at run time only
            """TRL's trainer, each precompute pass charged to the task whose batch it runs."""

            def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
                warmer._pass_begins()
                out = super()._precompute_ref_logps(dataset, name, batch_size)
                warmer._pass_ends()
                return out

        Precomputing.__name__ = Precomputing.__qualname__ = f"Precomputing{trainer.__name__}"
        return Precomputing


class DPOWarmer(_PreferenceWarmer):
    inner_phases: ClassVar[dict[str, str]] = {"ref": "train", "eval_ref": "eval"}
    phases = (*WARMED_PHASES, _PRECOMPUTE)
    ref_columns = ("ref_chosen_logps", "ref_rejected_logps")

    def layouts(self, task: WarmTask) -> list[PairedBatch]:
        """One batch per two planned completion-token counts (chosen half, rejected half), as long as the padded
        layout's longest row (or `seq` where the counts need full rows), then the padded layouts."""
        padded = super().layouts(task)
        longest = max(max(p + c, p + r) for p, c, r in padded[0].rows)
        counts = list(task.completion_tokens)
        counted = []
        for chosen, rejected in zip(counts[::2], counts[1::2] + counts[-1:], strict=False):
            batch = counted_batch(len(padded[0].rows), longest, chosen, rejected)
            counted.append(batch or counted_batch(len(padded[0].rows), task.seq, chosen, rejected))
        return [b for b in counted if b is not None] + padded

    def example(self, counts: tuple[int, ...], offset: int) -> dict[str, Any]:
        prompt, chosen, rejected = counts
        vocab = self.tokenizer.vocab_size
        return {"prompt_ids": token_ids(prompt, vocab, offset), "chosen_ids": token_ids(chosen, vocab, offset + 1),
                "rejected_ids": token_ids(rejected, vocab, offset + 2)}

    def trainer_type(self) -> Any:
        return taking_prepared_rows(super().trainer_type())


def kto_batch(rows: int, longest: int, kl_longest: int | None, desirable: int, counts: tuple[int, int]
              ) -> PairedBatch | None:
    """B KTO rows, the first `desirable` of them desirable, whose completions hold `counts` tokens (desirable,
    undesirable), whose longest row is `longest` and longest KL row `kl_longest` (None: no KL rows); None when
    they do not fit.

    One row (the carrier) is both longest: prompt `longest - c` and KL completion `kl_longest - prompt`, which needs
    its completion c >= longest - kl_longest; the other rows have a one-token prompt and an empty KL completion.
    """
    kl = kl_longest if kl_longest is not None else longest
    room = longest - 1  # completion tokens a row can hold: a one-token prompt at least
    forced = max(0, longest - kl)
    sizes = (desirable, rows - desirable)
    for side in (0, 1):
        if sizes[side] == 0 or any(sizes[s] * room < counts[s] for s in (0, 1)) or counts[side] < forced:
            continue
        need = list(counts)
        carried = min(room, need[side])
        need[side] -= carried
        out = []
        carrier = 0 if side == 0 else desirable
        for i in range(rows):
            s = 0 if i < desirable else 1
            if i == carrier:
                prompt = longest - carried
                out.append((prompt, carried, kl - prompt, int(s == 0)))
                continue
            take = min(room, need[s])
            need[s] -= take
            out.append((1, take, 0, int(s == 0)))
        return PairedBatch(tuple(out))
    return None


class KTOWarmer(_PreferenceWarmer):
    """KTO: each step runs the policy on the KL rows and on the rows, then the reference model on both. A planned
    `kl` (`eval_kl`) shape is run by the `train` (`eval`) step of a shape with as many rows: each such shape's
    batches take the KL lengths in turn."""

    inner_phases: ClassVar[dict[str, str]] = {"ref": "train", "kl": "train", "ref_kl": "train", "eval_ref": "eval",
                                              "eval_kl": "eval", "eval_ref_kl": "eval"}
    phases = (*WARMED_PHASES, _PRECOMPUTE)
    ref_columns = ("ref_logps", "ref_KL_logps")
    rows_per_example = 1

    def bind(self, plan: Plan) -> None:
        # (host phase, batch, seq) -> the KL seqs its batches carry: every KL shape goes to a host shape of its rows
        self._kl: dict[tuple[str, int, int], list[int]] = {}
        hosts_of: tuple[tuple[Phase, Phase], ...] = (("train", "kl"), ("eval", "eval_kl"))
        for host, kl_phase in hosts_of:
            for batch in {s.batch for s in plan.by_phase(host)}:
                hosts = sorted(s.seq for s in plan.by_phase(host) if s.batch == batch)
                kls = sorted(s.seq for s in plan.by_phase(kl_phase) if s.batch == batch)
                for i, seq in enumerate(kls):
                    self._kl.setdefault((host, batch, hosts[i % len(hosts)]), []).append(seq)
        super().bind(plan)

    def layouts(self, task: WarmTask) -> list[PairedBatch]:
        """Batches that meet every planned desirable-row count, completion-token count and KL length of the task:
        the counts in pairs (the large with the small, so that the carrier row's completion fits), then a batch for
        each value no pair could place."""
        cap = self.config.max_length
        multiple = self.config.pad_to_multiple_of

        def longest(seq: int) -> int:
            padded = seq - 1 if multiple not in (None, 1) and seq > 1 else seq
            return min(padded, cap) if cap is not None else padded

        kl_seqs: list[int | None] = list(self._kl.get((task.phase, task.batch, task.seq), [])) or [None]
        chosen = list(task.chosen_rows) or [0]
        values = sorted(task.completion_tokens, reverse=True) or [0]
        pairs = [(values[i], values[-1 - i]) for i in range((len(values) + 1) // 2)]
        out: list[PairedBatch] = []
        used: set[object] = set()

        def place(kl_seq: int | None, ks: list[int], counts: list[tuple[int, int]]) -> None:
            for k in ks:
                for pair in counts:
                    batch = kto_batch(task.batch, longest(task.seq), None if kl_seq is None else longest(kl_seq),
                                      k, pair)
                    if batch is not None:
                        out.append(batch)
                        used.update({("kl", kl_seq), ("k", k), ("v", pair[0]), ("v", pair[1])})
                        return

        for j in range(max(len(kl_seqs), len(chosen), len(pairs))):
            big, small = pairs[j % len(pairs)]
            place(kl_seqs[j % len(kl_seqs)], [chosen[j % len(chosen)], *chosen], [(big, small), (small, big)])
        for kl_seq in kl_seqs:
            if ("kl", kl_seq) not in used:
                place(kl_seq, chosen, [(v, w) for v in values for w in values])
        for k in chosen:
            if ("k", k) not in used:
                place(kl_seqs[0], [k], [(v, w) for v in values for w in values])
        for v in values:
            if ("v", v) not in used:
                place(kl_seqs[0], chosen, [(v, w) for w in values] + [(w, v) for w in values])
        return out

    def example(self, counts: tuple[int, ...], offset: int) -> dict[str, Any]:
        prompt, completion, kl_completion, desirable = counts
        vocab = self.tokenizer.vocab_size
        return {"prompt_ids": token_ids(prompt, vocab, offset), "completion_ids": token_ids(completion, vocab, offset),
                "KL_completion_ids": token_ids(kl_completion, vocab, offset + 1), "label": bool(desirable)}

    def trainer_type(self) -> Any:
        return taking_prepared_rows(super().trainer_type())


class RewardWarmer(_PreferenceWarmer):
    """Reward: TRL's RewardTrainer skips its preparation for rows that have chosen_ids/rejected_ids."""

    def example(self, counts: tuple[int, ...], offset: int) -> dict[str, Any]:
        prompt, chosen, rejected = counts
        vocab = self.tokenizer.vocab_size
        return {"chosen_ids": token_ids(prompt + chosen, vocab, offset),
                "rejected_ids": token_ids(prompt + rejected, vocab, offset + 1)}
