"""The options several commands share: how a run is named (`analyze`, `advise`, `warm`) and where it compiles
(`warm`, `verify`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from ..cache.limits import DEFAULT_LIMITS
from ..errors import UsageError
from ..services.trainers import DEFAULT_METHOD, METHODS
from ..warm.backends import DEVICES

Command = TypeVar("Command", bound=Callable[..., Any])


class FiniteFloat(click.FloatRange):
    """A float option within its range; NaN (which compares false with every bound) and infinity are refused."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def run_options(command: Command) -> Command:
    """The options `analyze`, `advise` and `warm` share to describe a run. The run's words may be a wrapped
    training command (`-- trl sft ...`, `-- accelerate launch ... trl sft ...`): the command sees its method and
    TRL's arguments (`run.unwrap_command`)."""

    body = command

    @functools.wraps(body)
    def unwrapped(**kwargs: Any) -> Any:
        from ..services.run import unwrap_command

        context = click.get_current_context()
        given = context.get_parameter_source("method") is not ParameterSource.DEFAULT
        method, words = unwrap_command(kwargs["method"] if given else None, kwargs["trl_args"])
        from ..services.run import script_command

        # the user's own script (script mode): it names its own data and model, its words are its own
        if script_command(words, method=kwargs["method"] if given else None, model=kwargs["model"],
                          eval_dataset=kwargs["eval_dataset"], split=kwargs["split"]) is not None:
            return body(**{**kwargs, "trl_args": words})
        check_own_options(context.command, words)
        from ..adapters.prechecks import refuse_before_imports
        from ..adapters.trl_args import own_options

        refuse_before_imports(words, model=kwargs["model"], eval_source=kwargs["eval_dataset"])
        names = [name for param in context.command.params for name in param.opts if name.startswith("-")]
        with own_options(str(context.command.name), names):  # an unknown option's hint looks at these first
            return body(**{**kwargs, "method": method or kwargs["method"], "trl_args": words})

    command = unwrapped  # type: ignore[assignment]  # functools.wraps keeps the signature click reads
    command = click.argument("trl_args", nargs=-1, type=click.UNPROCESSED)(command)
    command = click.option("--split", default=None, metavar="NAME",
                           help="Train split of DATASET (TRL: --dataset_train_split). Default: train.")(command)
    command = click.option("--eval-dataset", "eval_dataset", default=None, metavar="DATASET",
                           help="Plan the eval loop on this dataset instead of DATASET's test split.")(command)
    command = click.option("--model", default=None, metavar="MODEL",
                           help="Hub id or local folder (TRL: --model_name_or_path). Default: Qwen/Qwen3-0.6B.")(
        command)
    command = click.option("--method", type=click.Choice(METHODS, case_sensitive=False), default=DEFAULT_METHOD,
                           show_default=True,
                           help="The TRL trainer the run uses.")(command)
    return command


# shapeplan's own options that `accelerate launch` has too: after `--` (`-- accelerate launch -q trl sft ...`) they
# are the launcher's
_ALSO_ACCELERATES = ("-q", "--quiet")


def check_own_options(command: click.Command, words: tuple[str, ...]) -> None:
    """Refuse one of the command's own options misspelt in TRL's style (`--cache_dir` for `--cache-dir`) or given
    after `--`, where it would reach TRL: TRL has none of them, so the run would fail later with a vaguer line."""
    own = {name for param in command.params for name in param.opts if name.startswith("-")}
    for word in words:
        name = word.split("=", 1)[0]
        if not name.startswith("-"):
            continue
        # `-o` too: the `neuron_parallel_compile CMD` habit puts it at the end
        if name in own and name not in _ALSO_ACCELERATES:
            raise UsageError(f"{name} is `shapeplan {command.name}`'s own option: give it before `--`")
        if not name.startswith("--"):
            continue
        dashed = "--" + name[2:].replace("_", "-")
        if dashed in own:
            raise UsageError(f"unknown option {name!r}: did you mean {dashed}? (shapeplan's own options are spelt "
                             "with dashes, TRL's with underscores)")


def quiet_option(command: Command) -> Command:
    """-q/--quiet (`analyze`, `advise`, `warm`, `verify`): stderr carries only errors and warnings, no progress and
    no notes; stdout (the result) is unchanged."""
    from .output import remember_quiet

    return click.option("-q", "--quiet", is_flag=True, expose_value=False, is_eager=True, callback=remember_quiet,
                        help="Print only errors and warnings on stderr: no progress bars, per-shape rows or notes.")(
        command)


def device_option(command: Command) -> Command:
    """The options `warm` and `verify` share: where to compile, into which cache, and the report's format."""
    command = click.option("--cache-dir", "cache_dir", type=click.Path(file_okay=False), default=None,
                           metavar="DIR", help="Persistent compile cache (TORCH_NEURONX_NEFF_CACHE_DIR on neuron, "
                           "TORCHINDUCTOR_CACHE_DIR on cpu/cuda). Default: ~/.cache/shapeplan/<stack> "
                           "($SHAPEPLAN_CACHE_DIR overrides the root).")(command)
    command = click.option("--device", type=click.Choice(DEVICES), default=None,
                           help="Where to compile. Default: neuron if torch-neuronx is installed, else cuda if "
                           "available, else cpu.")(command)
    command = click.option("--json", "as_json", is_flag=True,
                           help="Print a machine-readable report on stdout.")(command)
    return command


def limit_options(command: Command) -> Command:
    """--max-gib, --max-files, --max-metadata-mib: the limits an archive read is checked against."""
    command = click.option("--max-metadata-mib", type=FiniteFloat(min=0, min_open=True),
                           default=DEFAULT_LIMITS.max_metadata / 2**20, show_default=True,
                           help="Refuse an archive whose metadata (checksum list) is larger than this.")(command)
    command = click.option("--max-files", type=click.IntRange(min=1), default=DEFAULT_LIMITS.max_files,
                           show_default=True, help="Refuse an archive holding more files than this.")(command)
    return click.option("--max-gib", type=FiniteFloat(min=0, min_open=True),
                        default=DEFAULT_LIMITS.max_bytes / 2**30, show_default=True,
                        help="Refuse an archive whose files expand to more than this.")(command)
