"""`analyze`: from `trl <method>` arguments to a `Plan`. Each method's adapter does the method-specific part.

An unchanged re-run is answered from the plan cache (`adapters/plan_cache.py`) before TRL, transformers, datasets
or torch is imported: seconds of imports are the whole cost of a cached answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..plan.model import Plan
from .trainers import MEASURED, trainer_spec

if TYPE_CHECKING:
    from ..adapters.script.command import ScriptCommand
    from ..adapters.trainer import TrainerSpec
    from ..adapters.trl_args import TrainingArgs


def analyze(method: str, argv: Sequence[str], *, eval_source: str | None = None, use_cache: bool = True,
            progress_bars: bool = True, parsed: TrainingArgs | None = None,
            tools: Sequence[Callable[..., Any]] = (), environment_factory: Any = None,
            rollout_func: Callable[..., Any] | None = None) -> Plan:
    """Plan the run `trl <method> ARGV` would make. ARGV holds TRL's options (and `--config FILE`); `eval_source` is
    a dataset to plan the eval loop on instead of the dataset's test split.

    `use_cache=False` plans afresh, neither reading nor writing the plan cache and the row-length cache.
    `progress_bars=False` keeps datasets' progress bars (tokenizing) off stderr.
    `parsed`: the run already parsed from exactly ARGV (`parse_training_args`, as `load_run` has it), planned
    without parsing it again.
    `tools`, `environment_factory`, `rollout_func`: what the run hands `GRPOTrainer` (the objects themselves; ARGV
    can name them as `--tools module:attr`, `--environment_factory module:attr`, `--rollout_func module:attr`). A
    plan with them is never cached.
    """
    words = [*argv, *(["--eval-dataset", eval_source] if eval_source else [])]
    spec = trainer_spec(method)
    if tools or environment_factory is not None or rollout_func is not None:
        from ..adapters.agentic import Agentic
        from ..adapters.trl_args import parse_training_args

        args = parsed or parse_training_args(spec, argv)
        given = Agentic(tools=tuple(tools), environment_factory=environment_factory, rollout_func=rollout_func,
                        pad_tool_turns=args.agentic.pad_tool_turns, pin_cache=args.agentic.pin_cache)
        if args.agentic:
            raise UsageError("tools, an environment factory or a rollout function are given both as objects and in "
                             "ARGV; pass them once")
        parsed = replace(args, agentic=given)
        use_cache = False
    return _cached(spec, words, lambda: list(argv), parsed=parsed, eval_source=eval_source,
                   use_cache=use_cache, progress_bars=progress_bars)


def analyze_command_line(method: str, words: Sequence[str], *, model: str | None = None, split: str | None = None,
                         eval_source: str | None = None, use_cache: bool = True, progress_bars: bool = True) -> Plan:
    """`analyze` for the run as `shapeplan analyze` names it: `words` are TRL's options and at most one bare DATASET,
    `model` and `split` stand for --model_name_or_path and --dataset_train_split."""
    from ..adapters.config_file import checked_config
    from ..adapters.script.command import is_script_command
    from ..adapters.trl_args import split_run_arguments

    if is_script_command(words):  # the user's own script: the run it builds
        return analyze_script(words, progress_bars=progress_bars)
    checked_config(words)  # a bad --config file is refused before TRL is imported
    spec = trainer_spec(method)
    key_words = [*words, *(["--model", model] if model else []), *(["--split", split] if split else []),
                 *(["--eval-dataset", eval_source] if eval_source else [])]
    # the key is read from the words as given: finding the bare DATASET among them takes TRL's parser
    return _cached(spec, key_words, lambda: split_run_arguments(spec, words, model, split), parsed=None,
                   eval_source=eval_source, use_cache=use_cache, progress_bars=progress_bars)


def _cached(spec: TrainerSpec, key_words: list[str], run_argv: Callable[[], list[str]], *,
            parsed: TrainingArgs | None, eval_source: str | None, use_cache: bool, progress_bars: bool) -> Plan:
    """The plan cache's plan for `key_words`, or the plan of TRL's `run_argv()` (`parsed`, where the caller has
    parsed it), stored under them."""
    from ..adapters import plan_cache
    from ..adapters.host import workers_setting

    workers_setting()  # a bad $SHAPEPLAN_WORKERS is refused whether or not this run forks
    key = plan_cache.plan_key(spec.name, key_words) if use_cache else None
    plan = plan_cache.load(key) if key is not None else None
    if plan is None:
        argv = run_argv()  # first: a mistyped option is refused in the time TRL's parser takes, before datasets loads
        dataset_progress_bars(progress_bars)
        from ..adapters.loop import dispatched_parts
        from ..adapters.trl_args import planning_args  # only planned: TRL's configs left unimported where they can be
        from ..warm.identity import beyond_position_embeddings

        args = parsed or planning_args(spec, argv)
        with dispatched_parts():  # any trainer whose batches rank 0 concatenates under dispatch_batches
            plan = spec.plan(args, argv, eval_source=eval_source, use_cache=use_cache)
        if eval_source is not None:  # what the printed `trl` command must load as the eval split (`warm --plan`)
            plan = replace(plan, config={**plan.config, "eval_dataset": eval_source})
        beyond = beyond_position_embeddings(plan, args)
        if beyond is not None:  # the run fails (or extrapolates) there; `warm` refuses such a plan
            plan = replace(plan, warnings=(*plan.warnings, f"{beyond}: lower --max_length to fit the model"))
        # tools are code: their schemas change with no word of the key; images are files the data only names
        if key is not None and not args.agentic and not any(s.pixel_values for s in plan.shapes):
            plan_cache.store(key, plan)
    return plan


def plan_parsed(args: TrainingArgs, *, progress_bars: bool = True) -> Plan:
    """The plan of a run already read into `args` (a script's, `services/script.py`), never cached: its objects are
    code and data no key names."""
    return _cached(args.spec, [], lambda: [], parsed=args, eval_source=None, use_cache=False,
                   progress_bars=progress_bars)


def analyze_script(command: Sequence[str] | ScriptCommand, *, progress_bars: bool = True) -> Plan:
    """The plan of the run a training script builds: `command` as after `--` (`["python", "train.py", ...]`,
    `["accelerate", "launch", "--num_processes", "2", "train.py"]`, `["torchrun", ...]`). The script runs in this
    process up to its trainer, which never trains; see docs/analyze.md ("Your own script")."""
    from ..adapters.script.command import ScriptCommand, parse_command
    from .script import script_args

    dataset_progress_bars(progress_bars)  # before the script maps its data
    parsed = command if isinstance(command, ScriptCommand) else parse_command(list(command))
    return plan_parsed(script_args(parsed), progress_bars=progress_bars)


def histogram_lengths(method: str, words: Sequence[str], *, model: str | None = None, split: str | None = None,
                      eval_source: str | None = None, use_cache: bool = True) -> tuple[int, ...]:
    """The untruncated train lengths `analyze --histogram` shows for the run as `shapeplan analyze` names it: what
    the method's `TrainerSpec.lengths` counts; refused for a method whose lengths it does not read."""
    from ..adapters.config_file import checked_config
    from ..adapters.row_lengths import train_lengths
    from ..adapters.trl_args import split_run_arguments

    checked_config(words)  # a bad --config file is refused before TRL is imported
    spec = trainer_spec(method)
    if spec.lengths is None:
        raise UsageError(f"token lengths are read for {', '.join(MEASURED)}, not {method}; drop --histogram")
    return train_lengths(spec, split_run_arguments(spec, words, model, split), eval_source=eval_source,
                         use_cache=use_cache)


def dataset_progress_bars(on: bool) -> None:
    """Turn datasets' progress bars off (`on=False`; a run's tokenizing draws one per step, noise in logs and pipes).
    Imports datasets only to turn them off."""
    if not on:
        import datasets

        datasets.disable_progress_bars()
