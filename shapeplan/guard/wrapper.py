"""Run a training command in this process with a `ShapeGuard` added to every Trainer it builds: the zero-code entry
(`shapeplan guard --plan plan.json -- trl sft --config sft.yaml`, `-- python train.py ...`, `-- train.py ...`,
`-- python -m package.module ...`). Data-parallel runs start this under `accelerate launch -m shapeplan guard`, so
every rank runs the command in-process and guards its own trainer.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from ..adapters.script.command import ScriptCommand, after_import, parse_command
from ..errors import UsageError, first_line

USAGE = "give the training command after `--`: `trl sft ARGS`, `python train.py ARGS`, `train.py ARGS` or " \
        "`python -m MODULE ARGS`"


TRAINER_MODULE = "transformers.trainer"


@contextmanager
def guarding(make_guard: Callable[[], Any]) -> Iterator[None]:
    """While active, every `transformers.Trainer` built gets `make_guard()` among its callbacks (before its
    `__init__` runs, so the guard sees the whole construction: DPO/KTO's reference precompute pass included).

    Nothing is imported here: the Trainer is patched when the command first imports transformers' trainer module,
    so the command's first lines run before torch loads, as they do unguarded (TorchNeuron reads its variables, sync
    mode's cache and lock dirs among them, at `import torch`)."""
    patched: list[tuple[Any, Any]] = []

    def patch(module: ModuleType) -> None:
        trainer = module.Trainer
        init = trainer.__init__
        signature = inspect.signature(init)

        def guarded_init(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments["callbacks"] = [*(bound.arguments.get("callbacks") or []), make_guard()]
            init(*bound.args, **bound.kwargs)

        trainer.__init__ = guarded_init  # restored below
        patched.append((trainer, init))

    hook = after_import(TRAINER_MODULE, patch)  # now, where `trl <method>` has loaded it to read its options
    try:
        yield
    finally:
        hook.remove()
        for trainer, init in patched:
            trainer.__init__ = init  # the original, saved above


def _trl_script(method: str, args: list[str]) -> Path:
    """The file `trl <method>` launches; refuses `accelerate launch` options, which `trl` would start processes
    for: a data-parallel run is `accelerate launch -m shapeplan guard ... -- trl <method> ...`."""
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    from ..adapters.config_file import checked_config

    checked_config(args)  # a bare --config, a YAML bomb or a 5,000-deep file: one line, as `analyze` refuses them
    try:
        module = importlib.import_module(f"trl.scripts.{method}")
    except ModuleNotFoundError as exc:
        raise UsageError(f"`trl {method}` is not a TRL training command; {USAGE}") from exc
    parser = module.make_parser(prog=f"trl {method}")
    try:
        with warnings.catch_warnings():  # the run parses them again and shows its own notices
            warnings.simplefilter("ignore", FutureWarning)
            script, *_, config_remaining, cli_remaining = parser.parse_args_and_config(
                args, return_remaining_strings=True, separate_remaining_strings=True)
    except ValueError as exc:  # a config's own check (TrainingArguments.__post_init__)
        raise UsageError(f"`trl {method}` refuses its options: {first_line(exc).rstrip('.')}{_fix(exc)}") from exc
    _check_loadable(method, getattr(script, "dataset_name", None))
    launch = resolve_accelerate_config_argument(config_remaining + cli_remaining)
    if launch:
        raise UsageError(f"accelerate options ({' '.join(launch)}) start processes of their own; run "
                         f"`accelerate launch {' '.join(launch)} -m shapeplan guard --plan PLAN -- trl {method} ...` "
                         "instead")
    return Path(module.__file__ or "")


def _fix(exc: Exception) -> str:
    """The fix for a refusal the guide's own options meet on a machine they were not written for."""
    if "bf16" in str(exc):  # TRL's configs default to bf16=True, which transformers refuses without an accelerator
        return "; TRL trains in bf16 by default: on a machine without an accelerator add --use_cpu true " \
               "(or --bf16 false)"
    return ""


def _check_loadable(method: str, dataset_name: str | None) -> None:
    """`trl <method>` loads --dataset_name with `datasets.load_dataset(NAME)`, which reads a Hub id or a folder of
    data files, never a single file (shapeplan reads one with its format's builder): refuse it before the run."""
    if dataset_name and Path(dataset_name).is_file():
        raise UsageError(f"`trl {method}` cannot load the file {dataset_name} given as --dataset_name "
                         "(datasets.load_dataset reads a Hub id or a folder); pass the folder holding it (alone), or "
                         f"name it in the --config file as `datasets: [{{path: json, data_files: {dataset_name}}}]`")


def command_runner(command: list[str]) -> Callable[[], None]:
    """What runs `command` in this process as its own `__main__`, with its own `sys.argv` and, as `python` has it,
    its folder (`-m`: the working directory) first on `sys.path` (checked now, so a mistyped command is refused
    before any library loads)."""
    words = list(command)
    if words and Path(words[0]).name.startswith("python"):
        words = words[1:]
    if not words:
        raise UsageError(f"no training command; {USAGE}")
    if words[0] == "trl" and len(words) > 1:
        script = _trl_script(words[1], words[2:])
        return ScriptCommand(tuple(command), str(script), tuple(words[2:])).run
    if words[0] in ("-m", "--module") or words[0].endswith(".py"):
        return parse_command(words, usage=USAGE).run
    raise UsageError(f"cannot run {' '.join(command[:2])!r} in-process; {USAGE}")
