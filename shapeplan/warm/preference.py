"""What the DPO, KTO and Reward warmers share (warm/dpo.py, warm/kto.py, warm/reward.py): the real trainers, built
as `trl dpo|kto|reward` build them, train on synthetic prepared rows through `Trainer.train()`, with the
trainer-loop warm-up (shapeplan/warm/trainer_loop.py: fixed batches, per-shape accounting, the eval pass carried by
`eval_on_start`).

The DPO and Reward collators stack a batch's chosen sequences, then its rejected ones, and pad them together: a
planned `(2B, seq)` shape is `B` rows whose 2B sequence lengths are a synthetic layout of that shape. Not warmed
yet: Reward's optional `margin` column.

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
from typing import Any

from ..errors import PlanFileError
from ..plan.model import Phase, Plan
from .model import WarmTask
from .synthetic import SyntheticBatch, padded_batches
from .tracker import Tracker
from .trainer_loop import TrainerLoopWarmer

PRECOMPUTE: Phase = "ref_precompute"


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


class PreferenceWarmer(TrainerLoopWarmer[PairedBatch]):
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
        planned = self._precompute_passes([t for t in context if t.phase == PRECOMPUTE])
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
