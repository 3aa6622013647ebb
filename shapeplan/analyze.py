"""`analyze`: from `trl <method>` arguments to a `Plan`. Each method's adapter does the method-specific part.

An unchanged re-run is answered from the plan cache (`adapters/plan_cache.py`) before TRL, transformers, datasets
or torch is imported: seconds of imports are the whole cost of a cached answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from .plan.model import Plan
from .trainers import trainer_spec


def analyze(method: str, argv: Sequence[str], *, model: str | None = None, split: str | None = None,
            eval_source: str | None = None, use_cache: bool = True, progress_bars: bool = True) -> Plan:
    """Plan the run `trl <method> ARGV` would make. ARGV holds TRL's options (and `--config FILE`), and may name the
    dataset as a bare word; `model` and `split` stand for --model_name_or_path and --dataset_train_split, and
    `eval_source` is a dataset to plan the eval loop on instead of the dataset's test split.

    `use_cache=False` plans afresh, neither reading nor writing the plan cache and the row-length cache.
    `progress_bars=False` keeps datasets' progress bars (tokenizing) off stderr.
    """
    from .adapters import plan_cache

    spec = trainer_spec(method)
    # the key is read from the words as given: finding a bare DATASET among them takes TRL's parser
    words = [*argv, *(["--model", model] if model else []), *(["--split", split] if split else []),
             *(["--eval-dataset", eval_source] if eval_source else [])]
    key = plan_cache.plan_key(method, words) if use_cache else None
    plan = plan_cache.load(key) if key is not None else None
    if plan is None:
        dataset_progress_bars(progress_bars)
        from .adapters.trl_args import parse_training_args
        from .run import split_run_arguments

        run_argv = split_run_arguments(method, tuple(argv), model, split)
        plan = spec.plan(parse_training_args(method, run_argv), run_argv, eval_source=eval_source,
                         use_cache=use_cache)
        if key is not None:
            plan_cache.store(key, plan)
    return plan


def dataset_progress_bars(on: bool) -> None:
    """Turn datasets' progress bars off (`on=False`; a run's tokenizing draws one per step, noise in logs and pipes).
    Imports datasets only to turn them off."""
    if not on:
        import datasets

        datasets.disable_progress_bars()
