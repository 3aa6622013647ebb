"""The trainer-loop warm-up every non-generating trainer shares (SFT, DPO, KTO, Reward): the real TRL trainer,
built from the run's own config and model, trains on synthetic rows whose batches have exactly the planned shapes,
through `Trainer.train()` itself.

Running the Trainer's own loop (not a copy of it) is what makes the warm-up dispatch what training dispatches:
the loss path, dtype/autocast, gradient checkpointing, the fused LM head, `torch.compile`, the token count for the
loss, gradient clipping, the optimizer and scheduler steps, the logging reductions and the eval loop's
concatenations. Only the data differs: a fixed batch order over synthetic rows replaces the sampler.

Each train shape is one or more optimizer steps of `gradient_accumulation_steps` micro-batches of that shape;
the eval shapes run as one eval pass (`eval_on_start`) with as many batches as the planned pass. A step that
raises fails its shape; the loop restarts on the shapes left.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast

from ..errors import PlanFileError, first_line
from ..plan.model import Plan
from ..trainers import trainer_spec
from .identity import check_plan_identity, environment, load_run_tokenizer
from .model import WarmTask
from .runner import WARMED_PHASES, tasks_from_plan
from .tracker import Tracker

if TYPE_CHECKING:
    from transformers import TrainingArguments
    from trl import ModelConfig

BatchT = TypeVar("BatchT")  # a warmer's synthetic batch (SFT: SyntheticBatch; DPO, KTO, Reward: PairedBatch)


def run_logs(config: TrainingArguments, total_steps: int) -> bool:
    """Whether a run of `total_steps` optimizer steps logs at least once (`DefaultFlowCallback.on_step_end` /
    `on_epoch_end`): a log runs a few scalar reductions, which the warm-up then runs once."""
    strategy = str(getattr(config.logging_strategy, "value", config.logging_strategy))
    if strategy == "epoch" or (config.logging_first_step and total_steps >= 1):
        return True
    if strategy != "steps":
        return False
    every = math.ceil(total_steps * config.logging_steps) if config.logging_steps < 1 else int(config.logging_steps)
    return total_steps >= every


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
    shares: list[list[WarmTask]] | None = None  # never set: the runner splits no tasks among ranks (no lockstep)

    def __init__(self, args: Any) -> None:
        self.args = args
        self.method = args.method
        self.config = args.training
        self.torch_compile = bool(self.config.torch_compile)
        self.padding_free = self._padding_free()
        self._trainer: Any = None
        self.logs = False  # whether the planned run logs (set by bind)
        self.train_remainder = self.eval_remainder = 0  # set by bind
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
        if self.args.num_processes > 1:
            self.warnings.append(f"the run has {self.args.num_processes} processes and the warm-up one: every "
                                 "rank's shapes are warmed, the collectives between ranks are not")
        self.logs = run_logs(self.config, plan.stats.optimizer_steps)
        self._remainders(plan)

    def _steps_in_epoch(self, rows: int) -> int:
        from ..adapters.sampling import train_batches

        cfg = self.config
        return len(train_batches(rows, batch_size=cfg.per_device_train_batch_size,
                                 num_processes=self.args.num_processes, strategy="sequential", seed=0,
                                 data_seed=None, drop_last=cfg.dataloader_drop_last)(0)[0])

    def _remainders(self, plan: Plan) -> None:
        """The rows of the last, short batch of an epoch / eval pass, where the run meets one (0: none).

        At the end of a dataloader accelerate's `gather_for_metrics` cuts gathered metrics to that many rows,
        so the warm-up's dataloaders report the same remainder. Several ranks fill their last eval batches with
        rows from the start (even batches): none is short.
        """
        cfg = self.config
        self.train_remainder = self.eval_remainder = 0
        # A stream has no length: accelerate's remainder stays -1 and `gather_for_metrics` cuts nothing.
        if cfg.dataloader_drop_last or getattr(self.args.script, "dataset_streaming", False):
            return
        if plan.stats.micro_batches >= self._steps_in_epoch(plan.stats.rows):
            self.train_remainder = plan.stats.rows % cfg.per_device_train_batch_size
        if self.args.num_processes == 1:
            self.eval_remainder = plan.stats.eval_rows % cfg.per_device_eval_batch_size

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
        """One eval pass shaped as the real one: each batch with the task it is charged to."""

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
        return trainer_spec(self.method).trainer()

    def _build_trainer(self, train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]] | None) -> Any:
        """The trainer as `trl <method>`'s main() builds it, on already prepared synthetic rows."""
        import datasets
        from transformers import PrinterCallback
        from trl import get_peft_config, get_quantization_config

        model_args = self.args.model
        script_config(self.config, model_args)
        trainer = self.trainer_type()(
            model=model_args.model_name_or_path,
            args=self.config,
            train_dataset=datasets.Dataset.from_list(train_rows),
            eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
            peft_config=get_peft_config(model_args),
            quantization_config=get_quantization_config(model_args),
        )
        trainer.remove_callback(PrinterCallback)  # it prints every log dict; the warm-up reports for itself
        return trainer

    def run(self, tasks: Sequence[WarmTask], context: Sequence[WarmTask], tracker: Tracker) -> None:
        with contextlib.redirect_stdout(sys.stderr):  # the trainer prints logs; stdout is for the report
            while True:
                pending = tracker.pending(tasks)
                if not pending:
                    return
                self._round(pending, context, tracker)

    def _round(self, pending: Sequence[WarmTask], context: Sequence[WarmTask], tracker: Tracker) -> None:
        train_tasks = [t for t in pending if t.phase == "train"]
        eval_tasks = [t for t in pending if t.phase == "eval"]
        carrier = None
        if not train_tasks:
            carrier = next((t for t in context if t.phase == "train"), None)
            if carrier is None:
                for task in eval_tasks:
                    tracker.fail(task, "the plan has no train shape to run the eval loop in")
                return
        steps = self._train_steps(train_tasks, carrier)
        evals = self._eval_batches(eval_tasks)
        train_rows, train_index = self.rows([b for s in steps for b in s.batches])
        eval_rows, eval_index = self.rows([b for _, b in evals])
        progress = _Progress(tracker, steps, [t for t, _ in evals], eval_tasks, logs=self.logs)
        try:
            if self._trainer is None:
                self._trainer = self._build_trainer(train_rows, eval_rows)
        except Exception as exc:  # the model or config cannot be used: no shape left can run
            for task in tracker.pending(pending):
                tracker.fail(task, first_line(exc, named=True))
            return
        trainer = self._trainer
        trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                              if not isinstance(c, _Progress)] + [progress]
        cfg = self.config
        _use_batches(trainer, (train_rows, train_index, cfg.per_device_train_batch_size, self.train_remainder),
                     (eval_rows, eval_index, cfg.per_device_eval_batch_size, self.eval_remainder))
        trainer.args.max_steps = len(steps)
        trainer.args.eval_on_start = bool(evals)
        try:
            trainer.train()
        except Exception as exc:  # a failing shape must not stop the others: record it, go on with the rest
            # Shapes finish in the order they run (the eval pass first, as one unit), so the first unfinished
            # one is where it failed.
            order = [*eval_tasks, *dict.fromkeys(s.task for s in steps if s.task is not None)]
            unfinished = [t for t in order if t not in tracker.results]
            if not unfinished:  # after the last shape (the loop's wrap-up): every shape had finished
                return
            failed = [t for t in unfinished if t.phase == "eval"] if unfinished[0].phase == "eval" else unfinished[:1]
            for task in failed:
                tracker.fail(task, first_line(exc, named=True))
        else:
            for task in pending:  # the loop ended early (a callback stopped it): these did not run
                if task not in tracker.results:
                    tracker.fail(task, "the trainer stopped before this shape")


def script_config(cfg: Any, model_args: ModelConfig) -> None:
    """Set `cfg` as `trl <method>`'s main() does (the model's init kwargs), and turn off what only steers the run's
    bookkeeping: no checkpoints, reports or progress bars of the trainer's own, evaluation only where the warmer
    asks for it."""
    from transformers.trainer_utils import IntervalStrategy, SaveStrategy

    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=cfg.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(cfg.model_init_kwargs or {})
    cfg.model_init_kwargs = model_init_kwargs
    cfg.output_dir = _scratch_output_dir()
    cfg.report_to = []
    cfg.save_strategy = SaveStrategy.NO
    cfg.eval_strategy = IntervalStrategy.NO
    cfg.load_best_model_at_end = False
    cfg.push_to_hub = False
    cfg.disable_tqdm = True


def _scratch_output_dir() -> str:
    """The trainer's output_dir, which the warm-up saves nothing into: removed when this process exits, and by the
    next warm-up if this one is killed first."""
    import atexit
    import shutil

    from ..plan.io import remove_stale

    remove_stale(Path(tempfile.gettempdir()), "shapeplan-warm-")
    folder = tempfile.mkdtemp(prefix=f"shapeplan-warm-{os.getpid()}-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


# rows, the row indices of each batch, the run's batch size, the remainder its dataloader reports
_Batches = tuple[list[dict[str, Any]], list[list[int]], int, int]


def _use_batches(trainer: Any, train: _Batches, evals: _Batches) -> None:
    """Make the trainer's dataloaders yield exactly these batches, collated and prepared as the Trainer does."""
    import datasets

    train_set = datasets.Dataset.from_list(train[0])
    eval_set = datasets.Dataset.from_list(evals[0]) if evals[0] else None
    trainer.train_dataset = train_set
    if eval_set is not None:
        trainer.eval_dataset = eval_set
    trainer.get_train_dataloader = lambda: prepared_loader(trainer, train_set, *train[1:], "training")
    trainer.get_eval_dataloader = lambda eval_dataset=None: prepared_loader(trainer, eval_set, *evals[1:], "evaluation")


class _FixedBatches:
    """A batch sampler with a fixed list of batches (the Trainer's own samplers pick rows at random); its
    `batch_size` is the run's, for accelerate's end-of-dataloader bookkeeping."""

    def __init__(self, batches: list[list[int]], batch_size: int) -> None:
        self.batches = batches
        self.batch_size = batch_size
        self.drop_last = False

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


class _Rows:
    """The synthetic rows, reporting the length that gives accelerate the run's remainder."""

    def __init__(self, rows: Any, total_dataset_length: int) -> None:
        self.rows = rows
        self.total_dataset_length = total_dataset_length

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)


def prepared_loader(trainer: Any, dataset: Any, index: list[list[int]], batch_size: int, remainder: int,
                    description: str) -> Any:
    """A dataloader of these batches, prepared by the trainer's accelerator, whose end-of-data bookkeeping reports
    `remainder` (what `gather_for_metrics` cuts the last batch's gathered values to)."""
    from torch.utils.data import DataLoader, Dataset

    dataset = trainer._remove_unused_columns(dataset, description=description)
    rows = cast("Dataset[Any]", _Rows(dataset, batch_size + remainder))  # map-style: __getitem__ and __len__
    loader: DataLoader[Any] = DataLoader(rows, batch_sampler=_FixedBatches(index, batch_size),
                                         collate_fn=trainer.data_collator, num_workers=0)
    return trainer.accelerator.prepare(loader)


def callback_base():
    """transformers' `TrainerCallback`, imported when a warmer module is (the base of the warmers' callbacks)."""
    from transformers import TrainerCallback

    return TrainerCallback


class _Progress(callback_base()):  # type: ignore[misc]  # a base class made at run time (transformers loads lazily)
    """Charges each optimizer step and each eval batch to its task as the Trainer runs them."""

    def __init__(self, tracker: Tracker, steps: list[_Step], eval_batches: list[WarmTask],
                 eval_tasks: list[WarmTask], *, logs: bool) -> None:
        self.tracker = tracker
        self.steps = steps
        self.eval_batches = eval_batches
        self.eval_tasks = eval_tasks
        self.logs = logs
        self.step = -1  # index of the optimizer step in progress
        self.evaluated = 0  # eval batches done

    def on_train_begin(self, args, state, control, **kwargs):
        self.tracker.start()

    def on_prediction_step(self, args, state, control, **kwargs):
        if self.evaluated < len(self.eval_batches):
            self.tracker.charge(self.eval_batches[self.evaluated])
        self.evaluated += 1

    def on_evaluate(self, args, state, control, **kwargs):
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
        # Log once if the planned run logs at all (the same scalar reductions every time), else never.
        control.should_log = self.logs and self.step == 0
        control.should_save = False
        control.should_evaluate = False
        return control
