"""`shapeplan analyze`: plan a TRL run's input shapes."""

from __future__ import annotations

import sys

import click

from ..errors import PlanFileError, UsageError
from ..plan.cost import GENERATE_SHAPE_MINUTES
from ..plan.model import Plan
from ..plan.targets import check_output, named_files, write_plan_output
from .options import FiniteFloat, quiet_option, run_options
from .output import emit_caveats, emit_plan, quiet


@click.command(
    "analyze",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True},
)
@run_options
@quiet_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON on stdout (for scripts).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, metavar="PLAN",
              help="Write the plan as JSON to PLAN (atomically), for `shapeplan warm --plan`.")
@click.option("--generate-compile-minutes", "generate_minutes", type=FiniteFloat(min=0), metavar="MIN",
              default=GENERATE_SHAPE_MINUTES, show_default=True,
              help="Minutes one static-cache generate size takes to compile (GRPO, RLOO), for the estimate.")
@click.option("--no-cache", "no_cache", is_flag=True,
              help="Plan afresh, neither reading nor writing the plan and row-length caches "
                   "($SHAPEPLAN_CACHE_DIR, default ~/.cache/shapeplan). TRL's parse of its own defaults, kept there "
                   "per TRL and transformers version, is still read (it holds no run's data).")
@click.option("--histogram", is_flag=True,
              help="Also print a histogram of the data's token lengths per pad bucket (on stderr under --json).")
@click.option("--compare", "compare", type=click.Path(dir_okay=False), default=None, metavar="RUN",
              help="Print the plan against RUN, the record of a guarded run (`shapeplan guard --record RUN`).")
def analyze_command(method: str, model: str | None, eval_dataset: str | None, split: str | None,
                    trl_args: tuple[str, ...], as_json: bool, output: str | None, generate_minutes: float,
                    no_cache: bool, histogram: bool, compare: str | None) -> None:
    """List every input shape a TRL run will feed the model.

    Tokenizes DATASET exactly as the TRL trainer will and replays its batch order, so the plan holds every
    (phase, batch, sequence length) the run meets, how often, and the first step that meets it.

    DATASET is a Hub id (trl-lib/Capybara), a local .jsonl/.json/.parquet/.csv file, or a save_to_disk folder.
    Every other option is TRL's, under TRL's name (see `trl sft --help`), and `--config FILE` reads the same
    YAML file as `trl sft --config`. pad_to_multiple_of defaults to 128, the value TRL resolves on Neuron;
    `--pad_to_multiple_of none` plans the unpadded run. accelerate options such as `--num_processes 2` plan
    a data-parallel run. GRPO's `tools=`, `environment_factory=` and `rollout_func=`, which no `trl` command
    passes, are named as `--tools module:attr`, `--environment_factory module:attr` and `--rollout_func
    module:attr`; tool turns are planned padded to the round's rows and with the static cache pinned at the
    longest length a call needs, as `shapeplan guard` makes the run do (`--pad_tool_turns false` and
    `--pin_cache false` plan them otherwise).

    \b
    Examples:
      shapeplan analyze trl-lib/Capybara
      shapeplan analyze data.jsonl --model ./my-model --max_length 2048 --packing -o plan.json
      shapeplan analyze --config sft.yaml --num_processes 4 --json
      shapeplan analyze --method grpo prompts.jsonl --tools my_tools:get_weather
    """
    from ..services.analyze import analyze_command_line

    if compare is not None and as_json:
        raise UsageError("--compare prints a table for people; drop --json (the run record is JSON already)")
    inputs = named_files([*trl_args, eval_dataset, compare, model])
    if output is not None:  # before the planning's minutes: an output that cannot be written is refused now
        check_output(output, "-o", inputs=inputs, what="plan")
    observed = load_observed(compare) if compare is not None else None
    plan = analyze_command_line(method, trl_args, model=model, split=split, eval_source=eval_dataset,
                                use_cache=not no_cache, progress_bars=sys.stderr.isatty() and not quiet())
    if observed is not None:
        from ..services.report import render_comparison

        if output is not None:
            write_plan_output(plan, output, inputs)
        click.echo(render_comparison(plan, observed))
        _keep_defaults(method)
        return
    lengths = None
    if histogram:  # before the plan is written: a run the histogram refuses writes nothing
        from ..services.analyze import histogram_lengths

        lengths = histogram_lengths(method, trl_args, model=model, split=split, eval_source=eval_dataset,
                                    use_cache=not no_cache)
    emit_plan(plan, as_json=as_json, output=output, generate_minutes=generate_minutes, inputs=inputs)
    if lengths is not None:
        from ..services.advice_report import histogram as render_histogram
        from ..services.advice_report import length_cap
        from ..services.trainers import trainer_spec

        if not (as_json and quiet()):  # under --json it goes to stderr, which -q keeps for errors and warnings
            click.echo(render_histogram(lengths, plan.pad_to_multiple_of, length_cap(plan),
                                        what=str(trainer_spec(method).lengths)), err=as_json)
    emit_caveats(plan, with_plan_warnings=False)
    _keep_defaults(method)


def _keep_defaults(method: str) -> None:
    """After a run planned whole: TRL's config defaults, read once, so that the next run plans without TRL's import
    (adapters/trl_args.py, `planning_args`); a refused run leaves no file."""
    from ..adapters.trl_args import keep_defaults
    from ..services.trainers import trainer_spec

    keep_defaults(trainer_spec(method))


def load_observed(path: str) -> Plan:
    """A run record; a plan made by `analyze` is refused (comparing two predictions says nothing about the run)."""
    from ..plan.io import load_plan

    observed = load_plan(path)
    if not observed.observed:
        raise PlanFileError(f"{path} is a plan, not a run record; record a run with `shapeplan guard --record RUN "
                            "...` and compare RUN")
    return observed
