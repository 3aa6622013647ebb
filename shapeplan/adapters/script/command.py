"""A training command as Python runs it: `python train.py ARGS`, `train.py ARGS`, `python -m package.module ARGS`,
and the same under `accelerate launch [options]` or `torchrun --nproc_per_node N`, run in this process as its own
`__main__` (`ScriptCommand.run`). The guard runs the user's command this way, and script mode (`shapeplan analyze
-- python train.py`) reads the run from it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ...errors import UsageError, first_line

USAGE = "give the training command after `--`: `python train.py ARGS`, `train.py ARGS`, `python -m MODULE ARGS`, " \
        "`accelerate launch [OPTIONS] train.py ARGS` or `torchrun --nproc_per_node N train.py ARGS`"


@dataclass(frozen=True)
class ScriptCommand:
    """A user's training script and the arguments it sees (`sys.argv`), with the processes its launcher starts."""

    words: tuple[str, ...]  # the command as given
    target: str  # the script's path, or the module's name (`module`)
    args: tuple[str, ...]  # what follows the script in sys.argv
    module: bool = False
    num_processes: int = 1

    @property
    def shown(self) -> str:
        """The command as the user typed it, quoted for a shell."""
        return shlex.join(self.words)

    @property
    def name(self) -> str:
        """The script's file name or the module's name, for messages."""
        return self.target if self.module else Path(self.target).name

    def run(self) -> None:
        """Run the script in this process as `python` would: as `__main__`, with its own `sys.argv`, its folder (or,
        for `-m`, the working directory) first on `sys.path`, so that it imports its neighbours."""
        saved_argv, saved_path = sys.argv, list(sys.path)
        sys.argv = [self.target, *self.args]
        sys.path.insert(0, os.getcwd() if self.module else str(Path(self.target).resolve().parent))
        try:
            if self.module:
                runpy.run_module(self.target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(self.target, run_name="__main__")
        finally:
            sys.argv = saved_argv
            sys.path[:] = saved_path


def is_script_command(words: Sequence[str]) -> bool:
    """Whether `words` start a Python training script (not a `trl` command, not a dataset)."""
    if not words:
        return False
    head = Path(words[0]).name
    return (head.startswith("python") or head in ("accelerate", "torchrun")
            or (words[0].endswith(".py") and Path(words[0]).is_file()))


def parse_command(words: Sequence[str], *, usage: str = USAGE) -> ScriptCommand:
    """The script `words` run, checked now (a mistyped path is refused before any library loads); `usage` ends a
    refusal (the commands the caller takes)."""
    words = tuple(words)
    head = Path(words[0]).name if words else ""
    if head == "accelerate":
        return _accelerate(words, usage)
    if head == "torchrun":
        return _torchrun(words, words[1:], usage)
    rest = _without_interpreter_options(list(words[1:])) if head.startswith("python") else list(words)
    if rest[:2] == ["-m", "torch.distributed.run"] or rest[:2] == ["-m", "torch.distributed.launch"]:
        return _torchrun(words, rest[2:], usage)
    return _plain(words, rest, 1, usage)


# python's own options before the script: the ones that change nothing shapeplan plans, alone or with a value
_PYTHON_FLAGS = ("-u", "-B", "-O", "-OO", "-s", "-E", "-I", "-b", "-bb", "-q")
_PYTHON_VALUED = ("-W", "-X")


def _without_interpreter_options(rest: list[str]) -> list[str]:
    while rest and (rest[0] in _PYTHON_FLAGS or rest[0] in _PYTHON_VALUED
                    or (rest[0][:2] in _PYTHON_VALUED and len(rest[0]) > 2)):
        rest = rest[2:] if rest[0] in _PYTHON_VALUED else rest[1:]
    return rest


def _plain(words: tuple[str, ...], rest: list[str], num_processes: int, usage: str) -> ScriptCommand:
    if not rest:
        raise UsageError(f"no training script; {usage}")
    if rest[0] in ("-m", "--module"):
        if len(rest) < 2:
            raise UsageError(f"-m names no module; {usage}")
        module = rest[1]
        try:
            found = _find_module(module)
        except (ImportError, ValueError):  # a missing parent package, an empty or relative name
            found = None
        if found is None:
            raise UsageError(f"no module named {module!r} to run with -m; install it or fix the name; {usage}")
        return ScriptCommand(words, module, tuple(rest[2:]), module=True, num_processes=num_processes)
    if rest[0].startswith("-"):
        raise UsageError(f"python option {rest[0]!r} is not supported here; {usage}")
    script = rest[0]
    if not Path(script).is_file():
        raise UsageError(f"training script {script} not found; {usage}")
    return ScriptCommand(words, script, tuple(rest[1:]), num_processes=num_processes)


def _find_module(module: str) -> Any:
    """`importlib.util.find_spec` with the working directory on `sys.path`, as `python -m` has it."""
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(module)
    finally:
        sys.path.pop(0)


def _accelerate(words: tuple[str, ...], usage: str) -> ScriptCommand:
    if words[1:2] != ("launch",):
        raise UsageError(f"`{' '.join(words[:2])}` starts no training run; use `accelerate launch [OPTIONS] "
                         f"train.py`; {usage}")
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()

    def error(message: str) -> None:  # argparse would print usage and exit; we want one line
        raise UsageError(f"{message}; see `accelerate launch --help`")

    parser.error = error  # argparse's hook, on this instance only
    known = parser.parse_args(list(words[2:]))
    from ..trl_args import launch_processes

    rest = (["-m"] if known.module else []) + [known.training_script, *known.training_script_args]
    return _plain(words, rest, launch_processes(known), usage)


def _torchrun(words: tuple[str, ...], options: Sequence[str], usage: str) -> ScriptCommand:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def error(message: str) -> None:
        raise UsageError(f"{message}; see `torchrun --help`")

    parser.error = error  # type: ignore[assignment]  # argparse's hook, on this instance only
    known = parser.parse_args(list(options))
    try:
        per_node = int(known.nproc_per_node)
        nodes = int(str(known.nnodes).split(":")[-1])
    except ValueError as exc:
        raise UsageError(f"torchrun's --nproc_per_node {known.nproc_per_node!r} / --nnodes {known.nnodes!r} name no "
                         "process count shapeplan can plan for; give whole numbers") from exc
    if per_node < 1 or nodes < 1:
        raise UsageError(f"torchrun starts {per_node} x {nodes} processes; give at least one")
    rest = (["-m"] if known.module else []) + [known.training_script, *known.training_script_args]
    return _plain(words, rest, per_node * nodes, usage)


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once `name` has been imported (by whoever imports it first), then leaves sys.meta_path.
    Installed with `after_import`, which calls `then` at once where the module is loaded already."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            self.then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader instance
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def after_import(name: str, then: Callable[[ModuleType], None]) -> AfterImport:
    """Call `then(module)` when `name` is imported, or now where it is; remove the returned hook when done."""
    hook = AfterImport(name, then)
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, hook)
    return hook


def script_failure(exc: BaseException, command: ScriptCommand) -> str:
    """`Type: first line (file:line)` of an error the script raised: the innermost frame of the script's own code."""
    where = None
    tb = exc.__traceback__
    target = str(Path(command.target).resolve()) if not command.module else None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if (target is not None and filename == target) or not library_code(filename):
            where = f"{Path(filename).name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return f"{type(exc).__name__}: {first_line(exc)}" + (f" ({where})" if where else "")


_SHAPEPLAN = Path(__file__).resolve().parents[2]
_STDLIB = Path(runpy.__file__).resolve().parent


def library_code(filename: str) -> bool:
    """Whether a frame's file belongs to an installed library, the standard library or shapeplan, not to the user's
    code."""
    path = Path(filename).resolve() if not filename.startswith("<") else None
    return path is None or {"site-packages", "dist-packages"} & set(path.parts) != set() or \
        path.is_relative_to(_SHAPEPLAN) or path.is_relative_to(_STDLIB)
