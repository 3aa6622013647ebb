"""The GRPO/RLOO warmer: the real `GRPOTrainer` / `RLOOTrainer`, built as `trl grpo` / `trl rloo` build it, trains
through `Trainer.train()` itself on synthetic prompts whose generation rounds have exactly the planned sizes.

One task per planned `generate` size (B, P, static cache length, max_new_tokens). Its rounds, each one generation
batch trained for `steps_per_generation * num_iterations` micro-steps as in the run:

1. the model's own `generate` with the trainer's GenerationConfig, decoded to the full `max_new_tokens` (the stop
   check runs as always; only its verdict waits for the last step), so every decode step's shapes are met: the
   attention mask and position ids grow a column per step. Before it, TRL's own post-processing runs for every
   generated length the run can meet: L < max_new_tokens (generation stops early only when every row emitted EOS)
   and L = max_new_tokens with 0..B rows ending in EOS (the EOS search indexes by a data-dependent row count);
2. one round per planned completion bucket C of this P (first task of each P only): `generate` returns a
   completion of a length L with R(L) = C, built on the host and moved to the device as TRL's own inputs are,
   so the old_logprob / ref forwards and the (B, P+C) train step run for every planned C.

Everything else is the trainer's own code: tokenizing is replaced by synthetic ids (host work), reward functions
by stand-ins returning 0.0 (host work; the number of reward functions, which sizes the rewards tensor, is kept).
A static cache's length is the running maximum over a model's `generate` calls; each warm `generate` is given its
planned length the way transformers carries it from call to call (`_previous_max_cache_length`), so sizes can be
warmed in any order and on any worker.

Planned `eval_generate` sizes (an `--eval_strategy` run) are tasks too, with the same rounds over the completion buckets
of the eval forwards, run after training by the Trainer's own eval loop (`trainer.evaluate()`), one eval batch per
round, in passes of as many batches as a planned eval pass.

A run with tools (GRPO's `tools=` / `environment_factory=`) builds the trainer with them (an environment's as one
probed instance's methods), so its tool mask and tool metrics run as in the run, on conversational placeholder
prompts. Each planned tool turn (a possible `generate` no round makes: k rows, bucket, cache length) is a task run
inside the first round of its side as the tool loop runs it: `_generate_single_turn` on k synthetic sequences, the
model's own `generate` at the planned cache length, then the post-processing of every length it can return.
A `rollout_func` run is built with warm's own function (`_rollout`): the round's call through
`_generate_single_turn`, an `env_mask` returned; the function's later calls are turn tasks.

Under `accelerate launch` every rank warms its own share of the tasks; ranks step together (gradients are
all-reduced and metrics gathered every round), so each rank runs the same number of rounds and `generate` calls,
padding its share with repeats of work already warmed.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, cast

from ..adapters.agentic import probed_tools
from ..adapters.lora import inner_model
from ..errors import UsageError, first_line
from ..plan.model import Plan
from .identity import check_plan_identity, environment, load_run_tokenizer, script_objects
from .rounds import (
    EVAL_ROUND_PHASES,
    ROUND_PHASES,
    Call,
    GenerateTask,
    Round,
    generation_tasks,
    lockstep,
    prompt_layouts,
    task_rounds,
    turn_calls,
)
from .tracker import Tracker
from .trainer_setup import callback_base, last_step_logs, run_logs, script_config


@dataclass
class _State:
    rounds: list[Round]
    index: int = -1  # round in progress
    call: Call | None = None  # the `_generate` call in progress


class GenerationWarmer:
    """Warms GRPO / RLOO shapes with the method's own trainer (see the module docstring)."""

    round_phases = ROUND_PHASES
    eval_round_phases = EVAL_ROUND_PHASES

    def __init__(self, args: Any) -> None:
        self.args = args
        self.method = args.method
        self.config = args.training
        self.torch_compile = bool(self.config.torch_compile)
        self.logs = self.logs_last = False  # whether the planned run logs, and at its last step (set by bind)
        self.multiple: int | None = None
        self.warnings: list[str] = []
        self.shares: list[list[GenerateTask]] | None = None  # every rank's tasks, set by the runner under ranks
        self.eval_batches = self.eval_remainder = 0  # one eval pass's generation batches, its remainder (set by bind)
        # the run's tools (an environment's as one probed instance's methods): the trainer runs its tool loop, tool
        # mask and tool metrics with them; the tool turns' `generate` calls are driven as planned (`turn_calls`)
        self.tools, environment_rewards = probed_tools(args.agentic)
        # a rollout function's run: the trainer takes one (`_rollout`) that makes each round's calls and returns an
        # env_mask, so the train step masks its loss as the run's does
        self.rollout = args.agentic.rollout_func is not None
        # checked here, before anything loads: a run without a reward function is a usage error, not a failed shape
        self.reward_funcs = self._reward_functions(environment_rewards)
        reward_model = getattr(args.script, "reward_model_name_or_path", None)
        if reward_model:  # the plan says so too: its inputs are re-tokenized text, a new length almost every round
            self.warnings.append(f"reward model {reward_model} is not warmed (its shapes are not planned): a "
                                 "stand-in scores the completions")

    # -- identity ---------------------------------------------------------------------------------------------

    @cached_property
    def tokenizer(self) -> Any:
        return load_run_tokenizer(self.args)

    def tasks(self, plan: Plan) -> tuple[GenerateTask, ...]:
        return generation_tasks(plan, self.round_phases, self.eval_round_phases)

    def bind(self, plan: Plan) -> None:
        check_plan_identity(plan, self.method, self.tokenizer, self.args.model.model_name_or_path)
        self.multiple = plan.pad_to_multiple_of
        self.logs = run_logs(self.config, plan.stats.optimizer_steps)
        self.logs_last = last_step_logs(self.config, plan.stats.optimizer_steps)
        # the generation batches of one eval pass on each rank (even batches: the plan's count over the ranks): the
        # eval loop concatenates their losses batch by batch (each concatenation length is an op of its own), so the
        # warm pass runs at least as many
        passes, ranks = max(plan.stats.evaluations, 1), self.args.num_processes
        self.eval_batches = sum(s.count for s in plan.by_phase("eval_generate")) // passes // ranks
        # accelerate cuts the last eval batch's gathered losses to the eval set's rows (its prompts, not the batch's
        # repeated rows) modulo every rank's batch together
        self.eval_remainder = plan.stats.eval_rows % (self.config.per_device_eval_batch_size * ranks)

    def environment(self) -> dict[str, Any]:
        return environment(self.args)

    # -- rounds -----------------------------------------------------------------------------------------------

    def _rounds(self, tasks: Sequence[GenerateTask]) -> list[tuple[list[Round], list[Round], list[GenerateTask]]]:
        """Every rank's (train rounds, eval-loop rounds, tool-turn tasks), each side's rounds in lockstep across
        ranks (a turn's `generate` has no collective: each rank runs its own)."""
        shares = self.shares if self.shares is not None else [list(tasks)]
        sides: list[list[list[Round]]] = [[], []]
        for share in shares:
            for side, phase in enumerate(("generate", "eval_generate")):
                rounds: list[Round] = []
                for task in (t for t in share if t.phase == phase and not t.turn):
                    layouts = prompt_layouts(task.batch, self._generations_per_prompt(), self.multiple)
                    rounds += task_rounds(task, self.multiple, layouts, len(shares), self.rollout)
                sides[side].append(rounds)
        train, evals = (lockstep(s) if len(s) > 1 and any(s) else s for s in sides)
        turns = [[t for t in share if t.turn] for share in shares]
        return list(zip(train, evals, turns, strict=True))

    def _generations_per_prompt(self) -> int:
        return self.config.num_generations

    def _micro_steps_per_round(self) -> int:
        """How many micro-steps train on one generation batch."""
        return self.config.steps_per_generation * self.config.num_iterations

    def _reward_functions(self, extra: int = 0) -> list[Any]:
        """Stand-ins for the run's reward functions and reward model, and `extra` more (an environment's
        `get_reward`); refusing a run without any."""
        return _stand_in_rewards(self.args.script, extra)

    @staticmethod
    def _single_turn(trainer: Any, prompt_ids: list[list[int]]) -> Any:
        """One tool-loop `generate` as GRPOTrainer's `_tool_call_loop` calls it: one completion per row."""
        return trainer._generate_single_turn(prompt_ids, None, {}, 1)

    # -- the run ----------------------------------------------------------------------------------------------

    def _build_trainer(self, rows: list[dict[str, Any]]) -> Any:
        """The trainer as the method's `trl` main() builds it, on synthetic prompt rows."""
        import datasets
        from transformers import PrinterCallback

        script_config(self.config, self.args.model)
        self.config.log_completions = False
        trainer = self._new_trainer(datasets.Dataset.from_list(rows))
        trainer.remove_callback(PrinterCallback)
        return trainer

    def _new_trainer(self, dataset: Any) -> Any:
        import trl

        model_args = self.args.model
        return self.args.spec.trainer()(
            model=model_args.model_name_or_path,
            reward_funcs=self.reward_funcs,
            args=self.config,
            train_dataset=dataset,
            peft_config=trl.get_peft_config(model_args),
            quantization_config=trl.get_quantization_config(model_args),
            **({"tools": self.tools} if self.tools else {}),
            **({"rollout_func": _rollout} if self.rollout else {}),
            **script_objects(self.args),
        )

    def run(self, tasks: Sequence[GenerateTask], context: Sequence[GenerateTask], tracker: Tracker) -> None:
        from accelerate import PartialState

        all_rounds = self._rounds(tasks)
        rounds, eval_rounds, turns = all_rounds[PartialState().process_index if len(all_rounds) > 1 else 0]
        with contextlib.redirect_stdout(sys.stderr):
            try:
                carrier = next((t for t in context if t.phase == "generate" and not t.turn), None)
                self._train(rounds, eval_rounds, turns, carrier, tracker)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # a failure stops the lockstep; every task not finished failed with it
                error = first_line(exc, named=True)
                for task in tracker.pending(tasks):
                    tracker.fail(task, error)

    def _train(self, rounds: list[Round], eval_rounds: list[Round], turns: list[GenerateTask],
               carrier: GenerateTask | None, tracker: Tracker) -> None:
        ga = self.config.gradient_accumulation_steps
        every = self._micro_steps_per_round()
        if not rounds and carrier is not None:  # only eval-loop work left: a train task's size carries the training
            rounds = [Round(None, Call(carrier.batch, carrier.seq, 1, carrier.batch))]
        # the tool turns run in the first round of their side (the eval loop's in train mode where it has none)
        eval_turns = [t for t in turns if t.phase == "eval_generate"] if eval_rounds else []
        for side, side_turns in ((rounds, [t for t in turns if t not in eval_turns]), (eval_rounds, eval_turns)):
            calls = tuple((t, call) for t in side_turns for call in turn_calls(t, self.multiple))
            if calls:
                side[0] = replace(side[0], turns=calls)
        # whole optimizer steps, and a step after the log where the run logs but not at its last step (see
        # `last_step_logs`): repeat warmed work
        after_log = 2 if self.logs and not self.logs_last else 1
        while (len(rounds) * every) % ga or len(rounds) * every < after_log * ga:
            rounds.append(Round(None, _repeat(rounds[-1].own)))
        passes = _eval_passes(eval_rounds, self.eval_batches)
        rows = [{"prompt": _placeholder(r.own, i, bool(self.tools))} for r in rounds for i in range(r.own.rows)]
        trainer = self._build_trainer(rows[: rounds[0].own.rows])
        state = _State(rounds + [r for p in passes for r in p])
        _use_rounds(trainer, rows, rounds, every)
        trainer.args.max_steps = len(rounds) * every // ga
        progress = _Progress(tracker, state, logs=self.logs, logs_last=self.logs_last)
        trainer.add_callback(progress)
        with _controlled_generation(trainer, state, tracker, self._filler_token(trainer), self._single_turn):
            trainer.train()
            for eval_pass in passes:  # the Trainer's own eval loop, one batch per eval round
                _use_eval_rounds(trainer, eval_pass, self.config.per_device_eval_batch_size, self.eval_remainder,
                                 self.args.num_processes)
                trainer.evaluate()
        if state.index >= 0:
            progress.end_round()

    def _filler_token(self, trainer: Any) -> int:
        eos = set(trainer.eos_token_ids)
        return next(i for i in range(10, 10 + len(eos) + 1) if i not in eos)


def _stand_in_rewards(script: Any, extra: int = 0) -> list[Any]:
    """One host-side stand-in per reward of the run, its reward model first as `trl grpo` puts it, and `extra` more
    (each returns 0.0; their number sizes the rewards); a run without one is refused."""
    names = [*([script.reward_model_name_or_path] if getattr(script, "reward_model_name_or_path", None) else []),
             *(getattr(script, "reward_funcs", None) or []), *[f"environment {i}" for i in range(extra)]]
    if not names:
        raise UsageError("the run has no reward function; pass --reward_funcs as for `trl grpo` / `trl rloo`")

    def make(index: int) -> Any:
        def reward(completions: list[Any], **kwargs: Any) -> list[float]:
            return [0.0] * len(completions)

        reward.__name__ = f"reward_{index}"
        return reward

    return [make(i) for i in range(len(names))]


def _rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
    """The run's rollout function in the warm-up: the round's call through `_generate_single_turn`, as a planned
    rollout makes each of its calls (the later ones are the plan's turn tasks), and an env_mask (its values are the
    run's business; its presence adds the mask to the loss)."""
    prompt_ids = trainer._tokenize_prompts(prompts)[0]
    completion_ids, logprobs = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs,
            "env_mask": [[1] * len(ids) for ids in completion_ids]}


def _repeat(call: Call) -> Call:
    """A call that repeats warmed work of `call`'s size (padding a round count)."""
    return Call(call.rows, call.prompt, call.length or 1, call.rows)


def _placeholder(call: Call, row: int, conversational: bool = False) -> Any:
    """The prompt of `row` of `call`: text naming its size, or (`conversational`: a run with tools, whose tool loop
    reads conversations) a user turn holding that text."""
    text = f"shapeplan:{call.prompt}:{row}:{int(call.unpadded)}"
    return [{"role": "user", "content": text}] if conversational else text


def _conversational(trainer: Any) -> bool:
    return bool(getattr(trainer, "tools", None))


def _prompt_ids(prompts: Sequence[Any], filler: int) -> list[list[int]]:
    """Synthetic ids for placeholder prompts: P tokens per row, but one fewer in the first row of a batch padded on
    the left (a single prompt too: a padded layout needs a padding multiple, which pads P - 1 to P)."""
    out = []
    for prompt in prompts:
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        _, p, row, unpadded = text.split(":")
        length = max(int(p) - 1, 1) if int(row) == 0 and unpadded == "0" else int(p)
        out.append([filler] * length)
    return out


def _use_rounds(trainer: Any, rows: list[dict[str, Any]], rounds: list[Round], every: int) -> None:
    """The train dataloader yields each round's generation batch `every` times, as TRL's RepeatSampler does."""
    from torch.utils.data import DataLoader, Dataset

    batches, start = [], 0
    for r in rounds:
        batches += [list(range(start, start + r.own.rows))] * every
        start += r.own.rows
    dataset = cast("Dataset[Any]", rows)  # a list is a map-style dataset: __getitem__ and __len__
    trainer.get_train_dataloader = lambda: DataLoader(dataset, batch_sampler=batches,
                                                      collate_fn=trainer.data_collator)


def _eval_passes(rounds: list[Round], batches: int) -> list[list[Round]]:
    """The eval rounds as eval passes of `batches` generation batches each, as many as a real pass runs (the loop
    concatenates the batches' losses one by one and cuts the last to the remainder: each length is an op of its own),
    the last pass padded with repeats of warmed work, the short batches of a pass last."""
    size = max(batches, 1)
    passes = [rounds[i:i + size] for i in range(0, len(rounds), size)]
    if passes:
        passes[-1] += [Round(None, _repeat(passes[-1][-1].own)) for _ in range(size - len(passes[-1]))]
    return [sorted(p, key=lambda r: -r.own.rows) for p in passes]


def _use_eval_rounds(trainer: Any, rounds: list[Round], batch_size: int, remainder: int, ranks: int) -> None:
    """The eval dataloader yields one batch of placeholder prompts per eval round (the eval loop generates for each
    batch, as TRL's `_prepare_inputs` does in eval mode), prepared as the Trainer's is, reporting the run's
    remainder."""
    import datasets

    from .trainer_setup import prepared_loader

    rows = [{"prompt": _placeholder(r.own, i, _conversational(trainer))} for r in rounds for i in range(r.own.rows)]
    batches, start = [], 0
    for r in rounds:
        batches.append(list(range(start, start + r.own.rows)))
        start += r.own.rows
    dataset = datasets.Dataset.from_list(rows)
    trainer.get_eval_dataloader = lambda eval_dataset=None: prepared_loader(trainer, dataset, batches, batch_size,
                                                                            remainder, "evaluation", ranks)


@contextlib.contextmanager
def _controlled_generation(trainer: Any, state: _State, tracker: Tracker, filler: int,
                           single_turn: Callable[[Any, list[list[int]]], Any]) -> Iterator[None]:
    """Make `trainer._generate` run each round's calls (a tool turn through `single_turn`, as the trainer's tool loop
    calls `_generate_single_turn`), and the model's `generate` do what each call says."""
    import torch
    from transformers.generation import utils as generation_utils

    model = trainer.model
    original_generate, original_call = model.generate, generation_utils.StopCheck.__call__
    original_generate_calls = trainer._generate
    eos = trainer.eos_token_ids[0]
    decode_to: list[int] = []  # the length the model's generate must reach before it may stop

    def stop_check(self, unfinished, tokens, length):
        stop = original_call(self, unfinished, tokens, length)  # the same device ops as always
        return stop and (not decode_to or length >= decode_to[-1])

    def generate(*args: Any, **kwargs: Any) -> Any:
        from accelerate import PartialState

        call = state.call
        assert call is not None
        input_ids = kwargs["input_ids"]
        if call.length is None:
            if call.cache_len is not None:
                # transformers sizes a static cache max(P + max_new_tokens - 1, max_cache_len, this attribute) and
                # keeps the result here: the planned length (the run's running maximum) is the largest of the three.
                # It reads and writes it on the model whose `generate` runs: under PEFT the one inside the wrapper.
                inner_model(model)._previous_max_cache_length = call.cache_len
            decode_to.append(input_ids.shape[1] + kwargs["generation_config"].max_new_tokens)
            try:
                return original_generate(*args, **kwargs)
            finally:
                decode_to.pop()
        rows, eos_rows = [], call.eos_rows_of(PartialState().process_index)
        for i in range(call.rows):
            completion = [filler] * call.length
            if i < eos_rows:
                completion[-1] = eos
            if call.short and i > 0:
                completion[0] = eos
            rows.append([filler] * input_ids.shape[1] + completion)
        return torch.tensor(rows).to(input_ids.device)  # built on the host, moved like TRL's own inputs

    def generate_calls(prompts: list[Any]) -> Any:
        if state.index >= 0:
            _Progress.charge_round(tracker, state)
        state.index += 1
        current = state.rounds[state.index]
        for call in current.before:
            state.call = call
            original_generate_calls([_placeholder(call, i, _conversational(trainer)) for i in range(call.rows)])
        if current.turns:
            _Progress.charge_round(tracker, state, ending=False)
            for n, (task, call) in enumerate(current.turns):  # as the tool loop calls it: no collective
                state.call = call
                single_turn(trainer, _prompt_ids([_placeholder(call, i) for i in range(call.rows)], filler))
                if n + 1 == len(current.turns) or current.turns[n + 1][0] != task:  # the task's last call
                    tracker.finish(task)
        state.call = current.own
        return original_generate_calls(prompts)

    model.generate = generate
    trainer._tokenize_prompts = lambda prompts: (_prompt_ids(prompts, filler), None, {})
    trainer._generate = generate_calls
    generation_utils.StopCheck.__call__ = stop_check  # type: ignore[method-assign]  # patched for the warm-up, restored below
    try:
        yield
    finally:
        generation_utils.StopCheck.__call__ = original_call  # type: ignore[method-assign]  # the restore
        del model.generate, trainer._tokenize_prompts, trainer._generate


class _Progress(callback_base()):  # type: ignore[misc]  # a base class made at run time (transformers loads lazily)
    """Starts the clock when training starts; steers logging, saving and evaluation as the trainer-loop warmer
    does."""

    def __init__(self, tracker: Tracker, state: _State, *, logs: bool, logs_last: bool) -> None:
        self.tracker = tracker
        self.state = state
        self.logs = logs
        self.logs_last = logs_last
        self.steps = 0

    @staticmethod
    def charge_round(tracker: Tracker, state: _State, *, ending: bool = True) -> None:
        """The round in progress ends (`ending`; else its tool turns start): charge it to its task, and finish the
        task after its last round."""
        current = state.rounds[state.index]
        if current.task is None or current.task in tracker.results:
            tracker.start()  # padding rounds are charged to no task
            return
        if current.last and ending:
            tracker.finish(current.task)
        else:
            tracker.charge(current.task)

    def end_round(self) -> None:
        _Progress.charge_round(self.tracker, self.state)

    def on_train_begin(self, args, state, control, **kwargs):
        self.tracker.start()

    def on_step_end(self, args, state, control, **kwargs):
        # log once if the run logs at all, and at the last step where the run does (the flos gather's dtype)
        last = state.global_step >= state.max_steps
        control.should_log = (self.logs and self.steps == 0) or (self.logs_last and last)
        control.should_save = False
        control.should_evaluate = False
        self.steps += 1
        return control
