"""Run a user's training script up to its trainer and take the run from what it hands the trainer.

The script runs in this process as `python` would run it (`ScriptCommand.run`). While it runs, the `__init__` of
every TRL trainer class (and of `transformers.Trainer`) records its arguments and returns without running: no model
loads, no dataset is prepared, nothing is written. The trainer the script first uses (its `train()`, or any
attribute a real trainer would have) is the run; the script stops there. A script that builds trainers and uses
none is planned at the first it built.

While the script runs, its TRL configs resolve as on Trainium and build on any host: `pad_to_multiple_of="auto"`
is 128 (TRL's value on a `neuron` device), and, where the planning host has no accelerator, `use_cpu` is set so that
TRL's bf16 default does not refuse the CPU (it changes no shape).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ...errors import ScriptError, UsageError
from ..trl_args import NEURON_PAD_TO_MULTIPLE_OF, world_size
from .command import ScriptCommand, after_import, library_code, script_failure


@dataclass(frozen=True)
class Built:
    """One trainer the script built: the TRL class whose `__init__` it called, the class it built (a subclass of its
    own, maybe), where, and the arguments of that `__init__` (bound by name, defaults filled in)."""

    trainer_class: type
    built_as: type
    site: str
    arguments: dict[str, Any] = field(hash=False)

    @property
    def described(self) -> str:
        """`SFTTrainer (train.py:42)`, or `MyTrainer(SFTTrainer) (train.py:42)` for a subclass."""
        name = self.trainer_class.__name__
        shown = name if self.built_as is self.trainer_class else f"{self.built_as.__name__}({name})"
        return f"{shown} ({self.site})"


# the attribute of a config built while the script runs that holds its constructor's values (see `planning_configs`)
GIVEN = "_shapeplan_given"


class _Used(BaseException):
    """Raised where the script uses the trainer it built: a BaseException, so the script's `except Exception` lets it
    through."""

    def __init__(self, built: Built) -> None:
        super().__init__(built.described)
        self.built = built


class _Capture:
    def __init__(self) -> None:
        self.built: list[tuple[Any, Built]] = []
        self.used: Built | None = None

    def of(self, instance: Any) -> Built | None:
        return next((b for obj, b in self.built if obj is instance), None)


def capture(command: ScriptCommand, *, use_cpu: bool = True) -> Built:
    """The trainer `command`'s script trains. `use_cpu`: build its configs for the CPU (planning anywhere; False
    where the run's own device setting must hold, a warm-up on an accelerator)."""
    state = _Capture()
    failure: BaseException | None = None
    # what the script prints goes to stderr: stdout is for the plan (`--json`)
    with _intercepting(state, use_cpu=use_cpu), world_size(command.num_processes), redirect_stdout(sys.stderr):
        try:
            command.run()
        except _Used:
            pass
        except SystemExit as exc:
            if not state.built:
                code = exc.code if exc.code is not None else 0
                said = f": {code}" if isinstance(code, str) else f" (exit code {code})"
                raise ScriptError(f"{command.name} exited{said} before building a TRL trainer; shapeplan plans the "
                                  "run the script builds: run it as you train it (its arguments after "
                                  "`--`)") from exc
        except KeyboardInterrupt:
            raise
        except UsageError:
            raise
        except Exception as exc:  # the user's script can raise anything
            if not state.built:
                raise ScriptError(f"{command.name} failed before building its trainer: {script_failure(exc, command)}"
                                  "; fix the script, or run it with the arguments it trains with") from exc
            failure = exc
    built = state.used or (state.built[0][1] if state.built else None)
    if built is None:
        raise ScriptError(f"{command.name} finished without building a TRL trainer; shapeplan plans scripts that "
                          "build one (SFTTrainer, GRPOTrainer, ...) and call its train()")
    if failure is not None and state.used is None:
        raise ScriptError(f"{command.name} failed after building {built.described}, before training: "
                          f"{script_failure(failure, command)}; fix the script")
    return built


@contextmanager
def planning_configs(*, use_cpu: bool) -> Iterator[None]:
    """While active, TRL configs built resolve `pad_to_multiple_of="auto"` as on Trainium (128) and, with `use_cpu`,
    build for the CPU (TRL's bf16 default refuses a host without an accelerator; the device changes no shape)."""
    restore: list[Any] = []

    def configs(module: ModuleType) -> None:
        arguments = module.TrainingArguments
        original = arguments.__post_init__

        def post_init(self: Any) -> None:
            if getattr(self, "pad_to_multiple_of", None) == "auto":  # TRL resolves it to 128 on a neuron device
                self.pad_to_multiple_of = NEURON_PAD_TO_MULTIPLE_OF
            if use_cpu:
                self.use_cpu = True
            # what the script gave, before the config derives the rest (GRPO's generation batch from the steps, ...):
            # a what-if config is built again from these (`run.with_options`)
            self.__dict__[GIVEN] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
            original(self)

        arguments.__post_init__ = post_init
        restore.append(lambda: setattr(arguments, "__post_init__", original))

    hook = after_import("transformers.training_args", configs)
    try:
        yield
    finally:
        hook.remove()
        for undo in restore:
            undo()


@contextmanager
def _intercepting(state: _Capture, *, use_cpu: bool) -> Iterator[None]:
    restore: list[Any] = []

    def trainers(module: ModuleType) -> None:
        base = module.Trainer
        for cls in [base, *_subclasses(base)]:
            if cls is base or cls.__module__.startswith("trl."):
                _wrap(cls, state, restore)

        def init_subclass(cls: type, **kwargs: Any) -> None:
            super(base, cls).__init_subclass__(**kwargs)
            if cls.__module__.startswith("trl."):
                _wrap(cls, state, restore)

        base.__init_subclass__ = classmethod(init_subclass)
        train = base.train

        @functools.wraps(train)
        def used_train(self: Any, *args: Any, **kwargs: Any) -> Any:
            built = state.of(self)
            if built is None:
                return train(self, *args, **kwargs)
            state.used = built
            raise _Used(built)

        def getattr_hook(self: Any, name: str) -> Any:
            built = state.of(self)
            if built is not None and not name.startswith("__"):
                state.used = built
                raise _Used(built)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        base.train = used_train
        base.__getattr__ = getattr_hook

        def undo() -> None:
            del base.__init_subclass__, base.__getattr__
            base.train = train

        restore.append(undo)

    with planning_configs(use_cpu=use_cpu):
        hook = after_import("transformers.trainer", trainers)
        try:
            yield
        finally:
            hook.remove()
            for undo in reversed(restore):
                undo()


def _subclasses(cls: type) -> list[type]:
    out: list[type] = []
    subclasses: list[type] = cls.__subclasses__()
    for sub in subclasses:
        out += [sub, *_subclasses(sub)]
    return out


def _wrap(cls: type, state: _Capture, restore: list[Any]) -> None:
    """Make `cls.__init__` record its arguments instead of running (where the class defines one)."""
    original = cls.__dict__.get("__init__")
    if original is None:
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if state.of(self) is not None:  # a subclass's __init__ already took this trainer
            return
        site = _site(self)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as exc:
            raise UsageError(f"the script's {cls.__name__}(...) at {site} fails: {exc}; fix the call") from exc
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(signature.parameters)))  # self
        state.built.append((self, Built(cls, type(self), site, arguments)))

    cls.__init__ = init  # type: ignore[misc]  # restored below
    restore.append(lambda: setattr(cls, "__init__", original))


def _site(instance: Any) -> str:
    """`file:line` of the script's line that built `instance`: the innermost caller outside the libraries, shapeplan
    and the `__init__` of the script's own trainer subclass."""
    frame = sys._getframe(2)
    while frame is not None:
        if not library_code(frame.f_code.co_filename) and frame.f_locals.get("self") is not instance:
            return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]  # None ends the loop
    return "?"
