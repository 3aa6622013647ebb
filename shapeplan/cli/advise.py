"""`shapeplan advise`: what each choice costs in compile minutes, training minutes and data."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import ShapeplanError, UsageError
from .options import quiet_option, run_options
from .output import note, quiet


@click.command(
    "advise",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True},
)
@run_options
@quiet_option
@click.option("--calibrate", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="CACHE_DIR",
              help="Cost compiles and steps with what `shapeplan warm` measured in CACHE_DIR instead of the guide's "
                   "figures.")
@click.option("--json", "as_json", is_flag=True, help="Print the advice, cost model included, as JSON on stdout.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Also write one self-contained HTML page (histogram, what-if table, shapes) to FILE.")
@click.option("--allow-truncation", "allow_truncation", is_flag=True,
              help="Let the recommendation lose data (truncated or dropped rows, shorter completions).")
@click.option("--no-cache", "no_cache", is_flag=True,
              help="Tokenize afresh, neither reading nor writing the row-length cache.")
def advise_command(method: str, model: str | None, eval_dataset: str | None, split: str | None,
                   trl_args: tuple[str, ...], calibrate: Path | None, as_json: bool, html_file: str | None,
                   allow_truncation: bool, no_cache: bool) -> None:
    """Weigh what to change so the run compiles less and trains faster.

    Plans the run as given (the baseline) and every alternative: pad_to_multiple_of 64/128/256/512/none,
    max_length at each bucket edge below the current one, packing or padding-free, batch size x gradient
    accumulation pairs with the same effective batch, and for GRPO/RLOO/Distillation a pinned static cache length
    and max_completion_length at each bucket edge. Each is an exact plan; they are ranked by compile + training
    minutes, with the TRL flags, the change and the data lost. Takes the same DATASET and TRL options as
    `shapeplan analyze`. On a vision-language dataset (SFT, GRPO, RLOO) it weighs fixed image sizes instead, each
    height x width: vision graphs, compile minutes and pixels kept, and the `shapeplan.resize_images` call, of
    (height, width) pairs, that applies them.

    \b
    Examples:
      shapeplan advise data.jsonl --model ./my-model --max_length 2048
      shapeplan advise --method grpo trl-lib/tldr --html advice.html
      shapeplan advise data.jsonl --calibrate /var/cache/shapeplan --json
    """
    from ..adapters.script.command import is_script_command
    from ..adapters.trl_args import split_run_arguments
    from ..plan.io import write_atomic
    from ..services.advice_page import render_html
    from ..services.advice_report import advice_to_dict, render_advice, render_vision_advice
    from ..services.advise import advise, advise_script
    from ..services.analyze import dataset_progress_bars
    from ..services.trainers import trainer_spec
    from ..services.vision_advice import VisionAdvice, vision_advice_to_dict

    dataset_progress_bars(sys.stderr.isatty() and not quiet())
    advice: Any
    if is_script_command(trl_args):  # the user's own script: each what-if its config with the options changed
        advice = advise_script(trl_args, calibrate=calibrate, allow_truncation=allow_truncation)
    else:
        argv = split_run_arguments(trainer_spec(method), trl_args, model, split)
        advice = advise(method, argv, eval_source=eval_dataset, use_cache=not no_cache, calibrate=calibrate,
                        allow_truncation=allow_truncation)
    if isinstance(advice, VisionAdvice):
        if html_file is not None:
            raise UsageError("--html draws the text advice; vision advice is printed (or --json): drop --html")
        click.echo(json.dumps(vision_advice_to_dict(advice), indent=2) if as_json else render_vision_advice(advice))
        return
    if html_file is not None:
        try:
            write_atomic(html_file, render_html(advice))
        except OSError as exc:
            raise ShapeplanError(f"cannot write {html_file}: {exc.strerror}; choose a writable path with --html") \
                from exc
    if as_json:
        click.echo(json.dumps(advice_to_dict(advice), indent=2))
    else:
        click.echo(render_advice(advice))
        if html_file is not None:
            note(f"page written to {html_file}")
