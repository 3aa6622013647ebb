"""`shapeplan analyze`: plan a TRL run's input shapes."""

from __future__ import annotations

import click

from ..errors import PlanFileError, UsageError
from ..plan.cost import GENERATE_SHAPE_MINUTES
from ..plan.io import write_plan
from ..plan.model import METHODS, Plan
from .output import emit_plan, progress_bars_on_terminals_only


def split_run_arguments(method: str, trl_args: tuple[str, ...], model: str | None, split: str | None) -> list[str]:
    """TRL's argv for the run: DATASET becomes --dataset_name, --model --model_name_or_path, --split the train split."""
    from ..adapters.trl_args import given_options, split_dataset_argument

    dataset, argv = split_dataset_argument(method, trl_args)
    given = given_options(argv)
    sugar = [("DATASET", dataset, "dataset_name"), ("--model", model, "model_name_or_path"),
             ("--split", split, "dataset_train_split")]
    prefix: list[str] = []
    for label, value, field in sugar:
        if value is None:
            continue
        if field in given:
            raise UsageError(f"both {label} and --{field} are given; pass only one")
        prefix += [f"--{field}", value]
    return prefix + argv


def run_options(command):  # type: ignore[no-untyped-def]
    """The options `analyze` and `warm` share to describe a run."""
    command = click.argument("trl_args", nargs=-1, type=click.UNPROCESSED)(command)
    command = click.option("--split", default=None, metavar="NAME",
                           help="Train split of DATASET (TRL: --dataset_train_split). Default: train.")(command)
    command = click.option("--eval-dataset", "eval_dataset", default=None, metavar="DATASET",
                           help="Plan the eval loop on this dataset instead of DATASET's test split.")(command)
    command = click.option("--model", default=None, metavar="MODEL",
                           help="Hub id or local folder (TRL: --model_name_or_path). Default: Qwen/Qwen3-0.6B.")(
        command)
    command = click.option("--method", type=click.Choice(METHODS), default="sft", show_default=True,
                           help="The TRL trainer the run uses.")(command)
    return command


@click.command(
    "analyze",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True},
)
@run_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON on stdout (for scripts).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, metavar="PLAN",
              help="Write the plan as JSON to PLAN (atomically), for `shapeplan warm --plan`.")
@click.option("--generate-compile-minutes", "generate_minutes", type=click.FloatRange(min=0), metavar="MIN",
              default=GENERATE_SHAPE_MINUTES, show_default=True,
              help="Minutes one static-cache generate size takes to compile (GRPO, RLOO), for the estimate.")
@click.option("--no-cache", "no_cache", is_flag=True,
              help="Plan afresh, neither reading nor writing the plan and row-length caches "
                   "($SHAPEPLAN_CACHE_DIR, default ~/.cache/shapeplan).")
@click.option("--compare", "compare", type=click.Path(dir_okay=False), default=None, metavar="RUN",
              help="Print the plan against RUN, the record of a guarded run (`shapeplan guard --record RUN`).")
def analyze_command(method: str, model: str | None, eval_dataset: str | None, split: str | None,
                    trl_args: tuple[str, ...], as_json: bool, output: str | None, generate_minutes: float,
                    no_cache: bool, compare: str | None) -> None:
    """List every input shape a TRL run will feed the model.

    Tokenizes DATASET exactly as the TRL trainer will and replays its batch order, so the plan holds every
    (phase, batch, sequence length) the run meets, how often, and the first step that meets it.

    DATASET is a Hub id (trl-lib/Capybara), a local .jsonl/.json/.parquet/.csv file, or a save_to_disk folder.
    Every other option is TRL's, under TRL's name (see `trl sft --help`), and `--config FILE` reads the same
    YAML file as `trl sft --config`. pad_to_multiple_of defaults to 128, the value TRL resolves on Neuron;
    `--pad_to_multiple_of none` plans the unpadded run. accelerate options such as `--num_processes 2` plan
    a data-parallel run.

    \b
    Examples:
      shapeplan analyze trl-lib/Capybara
      shapeplan analyze data.jsonl --model ./my-model --max_length 2048 --packing -o plan.json
      shapeplan analyze --config sft.yaml --num_processes 4 --json
    """
    from ..adapters import plan_cache

    if compare is not None and as_json:
        raise UsageError("--compare prints a table for people; drop --json (the run record is JSON already)")
    observed = load_observed(compare) if compare is not None else None

    words = [*trl_args, *(["--model", model] if model else []), *(["--split", split] if split else []),
             *(["--eval-dataset", eval_dataset] if eval_dataset else [])]
    key = None if no_cache else plan_cache.plan_key(method, words)
    plan = plan_cache.load(key) if key is not None else None
    if plan is None:
        from ..analyze import analyze

        progress_bars_on_terminals_only()
        argv = split_run_arguments(method, trl_args, model, split)
        plan = analyze(method, argv, eval_source=eval_dataset, use_cache=not no_cache)
        if key is not None:
            plan_cache.store(key, plan)
    if observed is not None:
        from ..report import render_comparison

        if output is not None:
            write_plan(plan, output)
        click.echo(render_comparison(plan, observed))
        return
    emit_plan(plan, as_json=as_json, output=output, generate_minutes=generate_minutes)


def load_observed(path: str) -> Plan:
    """A run record; a plan made by `analyze` is refused (comparing two predictions says nothing about the run)."""
    from ..plan.io import load_plan

    observed = load_plan(path)
    if not observed.observed:
        raise PlanFileError(f"{path} is a plan, not a run record; record a run with `shapeplan guard --record RUN "
                            "...` and compare RUN")
    return observed
