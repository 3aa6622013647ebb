"""The trainer-loop warm-up every non-generating trainer shares (SFT, DPO, KTO, Reward): the real TRL trainer,
built from the run's own config and model, trains on synthetic rows whose batches have exactly the planned shapes,
through `Trainer.train()` itself.

Running the Trainer's own loop (not a copy of it) is what makes the warm-up dispatch what training dispatches:
the loss path, dtype/autocast, gradient checkpointing, the fused LM head, `torch.compile`, the token count for the
loss, gradient clipping, the optimizer and scheduler steps, the logging reductions and the eval loop's
concatenations. Only the data differs: a fixed batch order over synthetic rows replaces the sampler.

Each train shape is one or more optimizer steps of `gradient_accumulation_steps` micro-batches of that shape;
the eval shapes run in eval passes (the first at `eval_on_start`, the others after train steps) of exactly as many
batches as a planned pass has per rank, the last padded with repeats. A step that raises fails its shape; the loop
restarts on the shapes left.

Under `accelerate launch` (a data-parallel plan) the ranks warm together through DDP: each rank runs its own share
of the tasks (the runner's `shares`), padded with repeats of warmed work so that every rank runs the same number of
optimizer steps and eval passes of the same length, so gradient all-reduces and the metric gathers meet on every
rank as in the run. Each rank's dataloaders yield exactly its own batches (accelerate would shard them), reporting
the run's remainder relative to every rank's rows. A failure stops the lockstep: every task left fails with it.
"""

from __future__ import annotations

import contextlib
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Generic, TypeVar

from ..errors import PlanFileError, first_line
from ..plan.model import Plan
from .identity import check_plan_identity, environment, load_run_tokenizer, script_objects
from .model import WarmTask
from .runner import WARMED_PHASES, tasks_from_plan
from .tracker import Tracker
from .trainer_setup import callback_base, last_step_logs, run_logs, script_config, use_batches

BatchT = TypeVar("BatchT")  # a warmer's synthetic batch (SFT: SyntheticBatch; DPO, KTO, Reward: PairedBatch)


@dataclass(frozen=True, slots=True)
class _Step:
    task: WarmTask | None  # None: a step that only carries the eval pass (its shape is already warmed)
    batches: tuple[Any, ...]  # one per micro-batch (the warmer's batch type)
    last: bool  # the task's last step
    steady: bool = False  # the task's first step once more, after it compiled: its steady-state seconds


class TrainerLoopWarmer(ABC, Generic[BatchT]):
    """Warms a plan's train and eval shapes through a TRL trainer's own loop (see the module docstring). A subclass
    says how a task becomes synthetic batches (`layouts`, `_eval_batches`) and how batches become prepared dataset
    rows (`rows`); the trainer is the method's TRL trainer (`trainer_type`), built as `trl <method>` builds it."""

    # phase -> the warmed phase whose step runs it on the same (batch, seq) (SFT: none)
    inner_phases: ClassVar[dict[str, str]] = {}
    phases: tuple[str, ...] = WARMED_PHASES  # the planned phases this warmer runs as tasks
    # sequences one dataset row puts in the batch (preference trainers stack chosen and rejected: 2)
    rows_per_example = 1
    # every rank's tasks, set by the runner under `accelerate launch` (the ranks step together); None: one process
    shares: list[list[WarmTask]] | None = None

    def __init__(self, args: Any) -> None:
        self.args = args
        self.method = args.method
        self.config = args.training
        self.torch_compile = bool(self.config.torch_compile)
        self.padding_free = self._padding_free()
        self._trainer: Any = None
        self.logs = self.logs_last = False  # whether the planned run logs, and at its last step (set by bind)
        self.train_remainder = self.eval_remainder = 0  # set by bind
        self.eval_short = 0  # rows of a pass's short last eval batch (0: none; set by bind)
        self.eval_pass = 0  # eval batches one planned pass runs on each rank (set by bind)
        self.warnings: list[str] = []

    def _padding_free(self) -> bool:
        """Whether the run's batches are padding-free (one row of packed documents)."""
        return False

    # -- identity -------------------------------------------------------------------------------------------

    @cached_property
    def tokenizer(self) -> Any:
        return load_run_tokenizer(self.args)

    def tasks(self, plan: Plan) -> tuple[WarmTask, ...]:
        """One task per planned train/eval shape."""
        return tasks_from_plan(plan, eval_passes=plan.stats.evaluations, inner_phases=self.inner_phases,
                               phases=self.phases)

    def bind(self, plan: Plan) -> None:
        """Check the plan is for this method and tokenizer; note whether the run logs and its remainders."""
        self.check_plan(plan)
        if (plan.by_phase("eval") and not plan.stats.evaluations) or any(
                s.cu_seq_lens and not s.varlen_pairs for s in plan.shapes):
            raise PlanFileError("the plan was made by an older shapeplan (it lacks its evaluations or its padding-free "
                                "pairs); re-create it with `shapeplan analyze`")
        self.logs = run_logs(self.config, plan.stats.optimizer_steps)
        self.logs_last = last_step_logs(self.config, plan.stats.optimizer_steps)
        self._remainders(plan)
        # with even batches every rank runs as many eval batches per pass: the plan's count over the ranks
        passes = max(plan.stats.evaluations, 1)
        self.eval_pass = sum(s.count for s in plan.by_phase("eval")) // passes // self.args.num_processes

    def _steps_in_epoch(self, rows: int) -> int:
        from ..adapters.loop import sharding
        from ..adapters.sampling import train_batches

        cfg = self.config
        return len(train_batches(rows, batch_size=cfg.per_device_train_batch_size,
                                 sharding=sharding(self.args), strategy="sequential", seed=0,
                                 data_seed=None, drop_last=cfg.dataloader_drop_last)(0)[0])

    def _remainders(self, plan: Plan) -> None:
        """The rows of an epoch's / eval pass's last gathered batch, where the run meets one (0: none): the rows
        modulo every rank's batch together (accelerate's `total_batch_size`: the dataloader's batch under
        split_batches, which the ranks share).

        At the end of a dataloader accelerate's `gather_for_metrics` cuts gathered metrics to that many rows,
        so the warm-up's dataloaders report the same remainder. In one process that is also the last eval batch's
        rows (`eval_short`); several ranks fill their last batches with rows from the start (even batches): none
        is short.
        """
        cfg = self.config
        ranks = self.args.num_processes
        self.train_remainder = self.eval_remainder = self.eval_short = 0
        # A stream has no length: accelerate's remainder stays -1 and `gather_for_metrics` cuts nothing.
        if cfg.dataloader_drop_last or getattr(self.args.script, "dataset_streaming", False):
            return
        together = 1 if cfg.accelerator_config.split_batches else ranks
        if plan.stats.micro_batches >= self._steps_in_epoch(plan.stats.rows) * ranks:
            self.train_remainder = plan.stats.rows % (cfg.per_device_train_batch_size * together)
        self.eval_remainder = plan.stats.eval_rows % (cfg.per_device_eval_batch_size * together)
        if ranks == 1:
            self.eval_short = self.eval_remainder

    def check_plan(self, plan: Plan) -> None:
        """The plan must have been made for this method, model and tokenizer."""
        check_plan_identity(plan, self.method, self.tokenizer, self.args.model.model_name_or_path)

    def environment(self) -> dict[str, Any]:
        return environment(self.args)

    # -- synthetic batches ----------------------------------------------------------------------------------

    @abstractmethod
    def layouts(self, task: WarmTask) -> list[BatchT]:
        """The synthetic batches that reproduce `task`."""

    @abstractmethod
    def rows(self, batches: Sequence[BatchT]) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """Prepared dataset rows for `batches`, and the row indices of each batch."""

    @abstractmethod
    def _eval_batches(self, tasks: Sequence[WarmTask]) -> list[tuple[WarmTask, BatchT]]:
        """The eval batches of `tasks`, in order, each with the task it is charged to: as many of a task as one
        pass runs on all ranks (`per_pass`), at least."""

    def _short(self, task: WarmTask | None) -> bool:
        """Whether `task` is the short last batch of an eval pass (`eval_short` rows)."""
        return False

    def _eval_passes(self, batches: list[tuple[WarmTask, BatchT]], context: Sequence[WarmTask], at_least: int = 0
                ) -> list[list[tuple[WarmTask | None, BatchT]]]:
        """`batches` as eval passes shaped as the real one (at least `at_least` of them): `eval_pass` batches each
        (the loop concatenates the losses batch by batch, each length an op of its own), the short batch last
        where the run has one, filled with repeats of warmed work (charged to no task)."""
        short = [b for b in batches if self._short(b[0])]
        full = [b for b in batches if not self._short(b[0])]
        others = self._eval_batches([t for t in context if t.phase == "eval"])
        fill = next(((None, b) for t, b in [*reversed(full), *others] if not self._short(t)), None)
        fill_short = next(((None, b) for t, b in [*reversed(short), *others] if self._short(t)), None)
        ends_short = bool(self.eval_short) and fill_short is not None
        per = max(max(self.eval_pass, 1) - ends_short, 1 if full else 0)
        count = max(-(-len(full) // per) if per else 0, len(short), at_least)
        passes: list[list[tuple[WarmTask | None, BatchT]]] = []
        for i in range(count):
            own: list[tuple[WarmTask | None, BatchT]] = list(full[i * per:(i + 1) * per])
            if fill is not None:
                own += [fill] * (per - len(own))
            if ends_short:
                own.append(short[i] if i < len(short) else fill_short)  # type: ignore[arg-type]
            passes.append(own)
        return passes

    def _schedule(self, tasks: Sequence[WarmTask], context: Sequence[WarmTask]
                  ) -> tuple[list[_Step], list[list[tuple[WarmTask | None, BatchT]]]]:
        """The optimizer steps and eval passes that warm `tasks`; without a train task, the plan's first train
        shape carries the loop (charged to no task)."""
        train = [t for t in tasks if t.phase == "train"]
        carrier = None if train else next((t for t in context if t.phase == "train"), None)
        steps = self._train_steps(train, carrier) if train or carrier is not None else []
        return steps, self._eval_passes(self._eval_batches([t for t in tasks if t.phase == "eval"]), context)

    def _train_steps(self, tasks: Sequence[WarmTask], carrier: WarmTask | None) -> list[_Step]:
        ga = self.config.gradient_accumulation_steps
        steps = []
        for task in ([carrier] if carrier is not None else tasks):
            layouts = self.layouts(task)
            n = -(-len(layouts) // ga)
            micro = [layouts[i % len(layouts)] for i in range(n * ga)]
            for s in range(n):
                steps.append(_Step(task=None if carrier is not None else task,
                                   batches=tuple(micro[s * ga:(s + 1) * ga]), last=s == n - 1))
            if carrier is None:
                steps.append(_Step(task=task, batches=tuple(micro[:ga]), last=False, steady=True))
        return steps

    # -- the run --------------------------------------------------------------------------------------------

    def trainer_type(self) -> Any:
        """The TRL trainer class the warm-up builds."""
        return self.args.spec.trainer()

    def _build_trainer(self, train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]] | None) -> Any:
        """The trainer as `trl <method>`'s main() builds it, on already prepared synthetic rows."""
        import datasets

        return self._new_trainer(datasets.Dataset.from_list(train_rows),
                                 datasets.Dataset.from_list(eval_rows) if eval_rows else None)

    def _trainer_kwargs(self) -> dict[str, Any]:
        """What the warmer gives the trainer besides `trl <method>`'s arguments (SFT: a vision run's processor)."""
        return {}

    def _new_trainer(self, train_dataset: Any, eval_dataset: Any) -> Any:
        """The trainer as `trl <method>`'s main() builds it, on these prepared datasets."""
        from transformers import PrinterCallback
        from trl import get_peft_config, get_quantization_config
        from trl.trainer.utils import global_then_local_main_first

        model_args = self.args.model
        script_config(self.config, model_args)
        # The run prepares its datasets in TRL's main-process-first scope, whose barriers are collectives of their
        # own; the synthetic rows come prepared, so the warm-up enters that scope itself (no-op in one process).
        with global_then_local_main_first():
            pass
        trainer = self.trainer_type()(
            model=model_args.model_name_or_path,
            args=self.config,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            peft_config=get_peft_config(model_args),
            quantization_config=get_quantization_config(model_args),
            **{**script_objects(self.args), **self._trainer_kwargs()},
        )
        trainer.remove_callback(PrinterCallback)  # it prints every log dict; the warm-up reports for itself
        return trainer

    def run(self, tasks: Sequence[WarmTask], context: Sequence[WarmTask], tracker: Tracker) -> None:
        with contextlib.redirect_stdout(sys.stderr):  # the trainer prints logs; stdout is for the report
            while True:
                pending = tracker.pending(tasks)
                if not pending and self.shares is None:
                    return
                self._round(pending, context, tracker)
                if self.shares is not None:  # ranks step together once: a failure stopped every rank
                    for task in tracker.pending(tasks):
                        tracker.fail(task, "a rank failed before this shape ran")
                    return

    def _rank_schedule(self, pending: Sequence[WarmTask], context: Sequence[WarmTask]
                       ) -> tuple[list[_Step], list[list[tuple[WarmTask | None, BatchT]]]]:
        """This rank's steps and eval passes: under `accelerate launch`, as many steps and passes as every other
        rank's, padded with repeats of warmed work; evaluating after steps needs a step before each pass but
        the first."""
        from accelerate import PartialState

        shares = [list(pending)] if self.shares is None else self.shares
        rank = 0 if self.shares is None else PartialState().process_index
        schedules = [self._schedule(share, context) for share in shares]
        steps, passes = schedules[rank]
        count = max(len(p) for _, p in schedules)
        if len(passes) < count:
            passes = self._eval_passes(self._eval_batches([t for t in pending if t.phase == "eval"]), context, count)
        if steps:
            # a run that logs but not at its last step ends on a step after a log (see `last_step_logs`)
            after_log = 2 if self.logs and not self.logs_last else 1
            total = max(max(len(s) for s, _ in schedules), len(passes) - 1, after_log)
            steps += [_Step(task=None, batches=steps[-1].batches, last=False)] * (total - len(steps))
        return steps, passes

    def _round(self, pending: Sequence[WarmTask], context: Sequence[WarmTask], tracker: Tracker) -> None:
        eval_tasks = [t for t in pending if t.phase == "eval"]
        steps, passes = self._rank_schedule(pending, context)
        if not steps:
            for task in eval_tasks:
                tracker.fail(task, "the plan has no train shape to run the eval loop in")
            return
        train_rows, train_index = self.rows([b for s in steps for b in s.batches])
        eval_sets = [self.rows([b for _, b in p]) for p in passes]
        progress = _Progress(tracker, steps, [t for p in passes for t, _ in p], eval_tasks, passes=len(passes),
                             logs=self.logs, logs_last=self.logs_last)
        try:
            if self._trainer is None:
                self._trainer = self._build_trainer(train_rows, eval_sets[0][0] if eval_sets else None)
        except Exception as exc:  # the model or config cannot be used: no shape left can run
            for task in tracker.pending(pending):
                tracker.fail(task, first_line(exc, named=True))
            return
        trainer = self._trainer
        trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                              if not isinstance(c, _Progress)] + [progress]
        cfg = self.config
        ranks = self.args.num_processes
        use_batches(trainer, (train_rows, train_index, cfg.per_device_train_batch_size, self.train_remainder),
                     [(rows, index, cfg.per_device_eval_batch_size, self.eval_remainder) for rows, index in eval_sets],
                     ranks)
        trainer.args.max_steps = len(steps)
        trainer.args.eval_on_start = bool(passes)
        try:
            trainer.train()
        except Exception as exc:  # a failing shape must not stop the others: record it, go on with the rest
            unfinished = [t for t in [*eval_tasks, *dict.fromkeys(s.task for s in steps if s.task is not None)]
                          if t not in tracker.results]
            if not unfinished:  # after the last shape (the loop's wrap-up): every shape had finished
                return
            # the eval pass or the train step in progress is where it failed
            if progress.evaluating:
                failed = [t for t in unfinished if t.phase == "eval"]
            else:
                failed = [t for t in unfinished if t.phase == "train"][:1] or unfinished
            for task in failed:
                tracker.fail(task, first_line(exc, named=True))
        else:
            for task in pending:  # the loop ended early (a callback stopped it): these did not run
                if task not in tracker.results:
                    tracker.fail(task, "the trainer stopped before this shape")


class _Progress(callback_base()):  # type: ignore[misc]  # a base class made at run time (transformers loads lazily)
    """Charges each optimizer step and each eval batch to its task as the Trainer runs them."""

    def __init__(self, tracker: Tracker, steps: list[_Step], eval_batches: list[WarmTask | None],
                 eval_tasks: list[WarmTask], *, passes: int, logs: bool, logs_last: bool) -> None:
        self.tracker = tracker
        self.steps = steps
        self.eval_batches = eval_batches
        self.eval_tasks = eval_tasks
        self.passes = passes
        self.logs = logs
        self.logs_last = logs_last
        self.step = -1  # index of the optimizer step in progress
        self.evaluated = 0  # eval batches done
        self.passes_done = 0
        self.evaluating = False  # an eval pass is in progress

    def on_train_begin(self, args, state, control, **kwargs):
        self.tracker.start()
        self.evaluating = self.passes > 0  # the first pass runs before the first step (`eval_on_start`)

    def on_prediction_step(self, args, state, control, **kwargs):
        task = self.eval_batches[self.evaluated] if self.evaluated < len(self.eval_batches) else None
        if task in self.eval_tasks:
            self.tracker.charge(task)
        else:  # a repeat of warmed work
            self.tracker.start()
        self.evaluated += 1

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluating = False
        self.passes_done += 1
        if self.passes_done == self.passes:
            for task in self.eval_tasks:
                self.tracker.finish(task)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step += 1

    def on_step_end(self, args, state, control, **kwargs):
        step = self.steps[self.step]
        if step.task is None:
            self.tracker.start()
        elif step.steady:
            self.tracker.steady(step.task, micro_batches=len(step.batches))
        elif step.last:
            self.tracker.finish(step.task)
        else:
            self.tracker.charge(step.task)
        # Log once if the planned run logs at all (the same scalar reductions every time), and at the last step where
        # the run does (see `last_step_logs`).
        last = self.step == len(self.steps) - 1
        control.should_log = (self.logs and self.step == 0) or (self.logs_last and last)
        control.should_save = False
        control.should_evaluate = self.evaluating = self.step < self.passes - 1  # the next eval pass, after this step
        return control
