"""TRL's own argument parsing: `trl <method>`'s parser and YAML config, plus accelerate's launch options.

shapeplan declares none of TRL's options itself: every `--name value` it does not own goes through
`trl.scripts.<method>.make_parser()` exactly as `trl <method>` parses it, and what TRL leaves over goes
through `accelerate launch`'s parser (for `--num_processes` and friends).
"""

from __future__ import annotations

import importlib
import math
import types
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError, first_line
from ..plan.io import MAX_BATCH, MAX_SEQ
from .agentic import Agentic, AgenticArguments, load
from .config_file import config_path, materialized, read_config
from .host import max_forks, process_count

if TYPE_CHECKING:
    from trl import ModelConfig, TrlParser

    from ..plan.model import Method
    from .trainer import TrainerSpec

# The model TRL's Trainium guide uses; `shapeplan analyze` with no arguments plans the guide's example (each
# method's dataset: `TrainerSpec.default_dataset`).
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
# TRL resolves pad_to_multiple_of="auto" to 128 on a `neuron` device; planning for Trainium means 128.
NEURON_PAD_TO_MULTIPLE_OF = 128


@dataclass(frozen=True)
class ScriptObjects:
    """What a user's training script hands its trainer besides the config (script mode, `shapeplan analyze --
    python train.py`): the objects themselves, planned as the trainer would take them."""

    command: tuple[str, ...]  # the command that built them, as given: a plan records it, `warm --plan` re-runs it
    trainer: str  # the trainer the script trains, and where it built it: `SFTTrainer (train.py:42)`
    train_dataset: Any
    eval_dataset: Any | None
    processing_class: Any | None  # None: loaded from the model's id, as the trainer does
    model: Any | None  # the model object, where the script passes one (None: a model id)
    peft_config: Any | None
    reward_funcs: tuple[Any, ...] = ()


@dataclass
class TrainingArgs:
    """What `trl <method>` would have parsed, plus the launch settings that change batching."""

    spec: TrainerSpec  # the method's, from the registry: what the layers below read of it
    script: Any  # ScriptArguments (or GRPOScriptArguments, ...)
    training: Any  # SFTConfig, GRPOConfig, ...
    model: ModelConfig
    dataset_mixture: Any | None  # DatasetMixtureConfig, where the method has one
    num_processes: int = 1
    given: frozenset[str] = field(default_factory=frozenset)  # options the user set, by TRL field name
    # tools, environments, a rollout function: objects, not TRL options (empty, and false, where the run has none)
    agentic: Agentic = field(default_factory=Agentic)
    # a script's own objects (script mode), planned instead of the data and tokenizer the options name
    objects: ScriptObjects | None = None

    @property
    def method(self) -> Method:
        return self.spec.name


def make_parser(spec: TrainerSpec) -> TrlParser:
    method = spec.name
    module = importlib.import_module(spec.script)
    parser = module.make_parser(prog=f"shapeplan analyze --method {method}")
    if spec.generates:  # what a generating trainer takes as Python objects, named as module:attr
        parser.dataclass_types.append(AgenticArguments)
        parser._add_dataclass_arguments(AgenticArguments)

    def error(message: str) -> None:  # argparse would print usage and exit; we want one line
        raise UsageError(f"{message}; see `trl {method} --help` for TRL's options")

    parser.error = error
    return parser


def given_options(argv: Sequence[str], *, config: bool = True) -> set[str]:
    """TRL field names set on the command line or (`config`) in a `--config` YAML file."""
    names: set[str] = set()
    args = list(argv)
    path = config_path(args)
    for token in args:
        if token == "--config":
            if config and path is not None:
                names |= set(read_config(path)) - {"env"}
        elif token.startswith("--"):
            names.add(token[2:].split("=", 1)[0].replace("-", "_"))
    return names


def parse_training_args(spec: TrainerSpec, argv: Sequence[str]) -> TrainingArgs:
    """Parse `argv` as `trl <method>` does (the method of `spec`); fill the guide's defaults for what the user left
    out."""
    method = spec.name
    argv = list(argv)
    given = given_options(argv)
    if "pad_to_multiple_of" not in given:
        argv = ["--pad_to_multiple_of", str(NEURON_PAD_TO_MULTIPLE_OF), *argv]
    else:
        argv = _auto_means_neuron(argv)
    if "model_name_or_path" not in given:
        argv = ["--model_name_or_path", DEFAULT_MODEL, *argv]
    if "dataset_name" not in given and "datasets" not in given:
        argv = ["--dataset_name", spec.default_dataset, *argv]
    if "output_dir" not in given:
        argv = ["--output_dir", "shapeplan-output", *argv]
    if "report_to" not in given:
        argv = ["--report_to", "none", *argv]
    if "use_cpu" not in given:
        # Planning runs anywhere; without it TrainingArguments refuses bf16 on a machine with no accelerator.
        argv = ["--use_cpu", "true", *argv]

    num_processes = _launch_num_processes(spec, _launch_options(spec, argv))
    parser = make_parser(spec)
    try:
        with world_size(num_processes), warnings.catch_warnings():
            # TRL's own defaults trip transformers' deprecation notices (gradient_checkpointing); none is the user's.
            warnings.simplefilter("ignore", FutureWarning)
            with materialized(argv) as words:  # TRL opens the config itself: a pipe is read once, here
                *parsed, _, _ = parser.parse_args_and_config(
                    words, return_remaining_strings=True, separate_remaining_strings=True
                )
    except UsageError:
        raise
    except (ValueError, TypeError) as exc:
        raise UsageError(f"invalid {_option_behind(argv, exc)}: {_plain(first_line(exc))}; see `trl {method} "
                         "--help`") from exc
    named = [item for item in parsed if isinstance(item, AgenticArguments)]
    parsed = [item for item in parsed if not isinstance(item, AgenticArguments)]
    script, training, model, *rest = parsed
    _check_values(method, parsed)
    _check_positive(training)
    _check_peft(model)
    return TrainingArgs(
        spec=spec,
        script=script,
        training=training,
        model=model,
        dataset_mixture=rest[0] if rest else None,
        num_processes=num_processes,
        given=frozenset(given),
        agentic=load(named[0] if named else None, given),
    )


def _plain(detail: str) -> str:
    """Python's conversion errors ("invalid literal for int() with base 10: 'abc'") in the user's words."""
    if detail.startswith("invalid literal for int()"):
        return "not a whole number"
    if detail.startswith("could not convert string to float"):
        return "not a number"
    return detail


def _option_behind(argv: Sequence[str], exc: Exception) -> str:
    """The option whose value `exc` (raised while parsing) names or fails to decode as JSON, as `--name value`."""
    import json

    pairs = [(word.split("=", 1)[0], word.split("=", 1)[1]) if word.startswith("--") and "=" in word
             else (word, argv[i + 1]) for i, word in enumerate(argv)
             if word.startswith("--") and ("=" in word or i + 1 < len(argv))]
    for option, value in pairs:
        if repr(value) in str(exc) or (isinstance(exc, json.JSONDecodeError) and value.lstrip().startswith("{")):
            kind = "JSON of " if isinstance(exc, json.JSONDecodeError) else "value of "
            return f"{kind}{option} {value!r}"
    return "TRL option"


def _launch_options(spec: TrainerSpec, argv: list[str]) -> list[str]:
    """What TRL's parser leaves over from `argv` and its `--config` file: the `accelerate launch` options."""
    parser = make_parser(spec)
    args = list(argv)
    config_remaining: list[str] = []
    if (path := config_path(args)) is not None:
        i = args.index("--config")
        config = read_config(path)
        config.pop("env", None)
        config_remaining = parser.set_defaults_with_config(**config)
        del args[i:i + 2]
        if config_remaining:  # keys no TRL option takes: accelerate's, or a misspelt key named with its file
            from accelerate.commands.launch import launch_command_parser

            actions = {**launch_command_parser()._option_string_actions, **parser._option_string_actions}
            for key in config_remaining[0::2]:  # ["--key", "value", ...]
                _known_action(spec.name, key, actions, config=path)
    _, unknown = parser.parse_known_args(args)
    return [*config_remaining, *unknown]


@contextmanager
def world_size(num_processes: int) -> Iterator[None]:
    """Configs built while parsing see the run's process count: GRPO and RLOO size the generation batch with it."""
    from transformers import TrainingArguments

    original = TrainingArguments.__dict__["world_size"]
    TrainingArguments.world_size = property(lambda self: num_processes)  # type: ignore[method-assign,assignment]  # plan N ranks in one process
    try:
        yield
    finally:
        TrainingArguments.world_size = original  # type: ignore[method-assign]  # the restore


# Sizes TRL accepts at parse time but the run fails on (a zero batch size, a zero padding multiple) or plans
# nonsense with (a negative max_length truncates every row to nothing).
_POSITIVE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
             "pad_to_multiple_of", "num_generations", "steps_per_generation", "generation_batch_size", "max_length",
             "max_prompt_length", "max_completion_length")


# Sizes beyond what a plan file holds (plan/io.py's bounds): no model takes them, and planning them exhausts memory.
_SEQUENCE_SIZES = ("pad_to_multiple_of", "max_length", "max_prompt_length", "max_completion_length")
_BATCH_SIZES = ("per_device_train_batch_size", "per_device_eval_batch_size", "num_generations",
                "generation_batch_size")
# transformers' `set_seed` seeds numpy, whose seeds are 32-bit: the run fails on a larger one.
_SEEDS = ("seed", "data_seed")
_MAX_SEED = 2 ** 32 - 1
# `datasets.map(num_proc=...)` forks this many processes while TRL prepares the data.
_FORKS = ("dataset_num_proc",)


def _check_positive(training: Any) -> None:
    for name in _POSITIVE:
        value = getattr(training, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be a positive integer, got {value}")
    for names, high in ((_SEQUENCE_SIZES, MAX_SEQ), (_BATCH_SIZES, MAX_BATCH)):
        for name in names:
            value = getattr(training, name, None)
            if value is not None and value > high:
                raise UsageError(f"--{name} {value} is beyond any model's reach (at most {high}); pass the run's "
                                 "real value")
    for name in _SEEDS:
        value = getattr(training, name, None)
        if value is not None and not 0 <= value <= _MAX_SEED:
            raise UsageError(f"--{name} must be from 0 to 2**32-1 (transformers' set_seed seeds numpy with it), "
                             f"got {value}")
    for name in _FORKS:
        value = getattr(training, name, None)
        if value is not None:
            process_count(f"--{name}", value, cap=max_forks(), what="what this host's cores can run")
    # without max_steps the epochs set the run's length: none (or fewer) trains nothing
    if getattr(training, "max_steps", -1) <= 0 and training.num_train_epochs <= 0:
        raise UsageError(f"--num_train_epochs must be positive (or --max_steps set), got {training.num_train_epochs}")


# A LoRA rank past any model's hidden size: the adapter matrices of such a rank exhaust memory before peft notices.
_MAX_LORA_R = 65536


def _check_peft(model: Any) -> None:
    """The LoRA settings as peft refuses them when it builds the adapters (every shape of a warm-up would fail on
    it), refused once, before any shape: a rank of at least 1, a dropout probability from 0 to 1."""
    if not getattr(model, "use_peft", False):
        return
    r, dropout = getattr(model, "lora_r", 1), getattr(model, "lora_dropout", 0.0)
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= _MAX_LORA_R:
        raise UsageError(f"--lora_r must be a whole number from 1 to {_MAX_LORA_R} (peft refuses a rank below 1), "
                         f"got {r!r}")
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout <= 1:
        raise UsageError(f"--lora_dropout must be a probability from 0 to 1 (torch's Dropout refuses others), got "
                         f"{dropout!r}")
    alpha = getattr(model, "lora_alpha", 1)
    if isinstance(alpha, float) and not math.isfinite(alpha):
        raise UsageError(f"--lora_alpha must be a finite number, got {alpha}")


def _check_values(method: str, configs: Sequence[Any]) -> None:
    """Every option of a scalar type holds a value of that type (a YAML config can give a list or null where the
    command line cannot), and no float option is NaN or infinite (they pass every range check)."""
    for config in configs:
        hints = _scalar_hints(type(config))
        _check_types(method, hints, {name: getattr(config, name) for name in hints})


_KIND_NAMES = {int: "whole number", float: "number", bool: "boolean", str: "string"}


def _check_types(method: str, hints: dict[str, tuple[type, ...]], values: dict[str, Any]) -> None:
    for name, value in values.items():
        kinds = hints.get(name)
        if kinds is None or (value is None and type(None) in kinds):
            continue
        wanted = " or ".join(_KIND_NAMES[k] for k in kinds if k is not type(None))
        fits = any(isinstance(value, k) and not (isinstance(value, bool) and k is not bool) for k in kinds) or (
            float in kinds and isinstance(value, int) and not isinstance(value, bool))
        if not fits:
            raise UsageError(f"--{name} must be a {wanted}, got {value!r}; fix it on the command line or in "
                             f"the --config file (see `trl {method} --help`)")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{name} must be a finite number, got {value}")


def check_recorded(args: TrainingArgs, config: dict[str, Any]) -> None:
    """A plan's recorded config (`args`: its arguments, parsed), checked as the command line's options are: a
    hand-edited value must not warm what no run can train."""
    values = {name: value for name, value in config.items() if name != "argv"}
    _check_types(args.method, _scalar_hints(type(args.training)), values)
    _check_positive(types.SimpleNamespace(**{**vars(args.training), **values}))
    if type(values.get("num_processes", 1)) is not int or values.get("num_processes", 1) < 1:
        raise UsageError(f"num_processes must be a positive integer, got {values['num_processes']!r}")


def _scalar_hints(config_type: type) -> dict[str, tuple[type, ...]]:
    """field name -> the scalar types its annotation allows (None among them for Optional), for the fields
    annotated with nothing but int, float, bool, str and None."""
    import dataclasses
    import typing

    scalars = {int, float, bool, str, type(None)}
    try:
        hints = typing.get_type_hints(config_type)
    except Exception:  # an annotation that does not resolve: no field of it is checked
        return {}
    out: dict[str, tuple[type, ...]] = {}
    for item in dataclasses.fields(config_type):
        hint = hints.get(item.name)
        kinds = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if kinds and all(k in scalars for k in kinds):
            out[item.name] = tuple(kinds)
    return out


def _auto_means_neuron(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, token in enumerate(out):
        if token in ("--pad_to_multiple_of", "--pad-to-multiple-of") and i + 1 < len(out) and out[i + 1] == "auto":
            out[i + 1] = str(NEURON_PAD_TO_MULTIPLE_OF)
        elif token in ("--pad_to_multiple_of=auto", "--pad-to-multiple-of=auto"):
            out[i] = f"--pad_to_multiple_of={NEURON_PAD_TO_MULTIPLE_OF}"
    return out


def _launch_num_processes(spec: TrainerSpec, leftovers: list[str]) -> int:
    """Read `accelerate launch` options TRL passes through; anything else is an unknown option."""
    if not leftovers:
        return 1
    from accelerate.commands.launch import launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    try:
        launch_args = resolve_accelerate_config_argument(leftovers)
    except ValueError as exc:
        raise UsageError(f"{first_line(exc)}") from exc
    parser = launch_command_parser()

    def error(message: str) -> None:  # argparse would print usage and exit; we want one line
        raise UsageError(f"{message}; see `accelerate launch --help` for launch options")

    parser.error = error
    # "shapeplan" stands for the training script accelerate expects; a bare token before it is a stray argument.
    known, unknown = parser.parse_known_args([*launch_args, "shapeplan"])
    if unknown:
        _known_action(spec.name, unknown[0].split("=", 1)[0],
                      {**parser._option_string_actions, **make_parser(spec)._option_string_actions})
        raise UsageError(f"unexpected argument {unknown[0]!r}; see `trl {spec.name} --help`")
    if known.training_script != "shapeplan":
        raise UsageError(f"unexpected argument {known.training_script!r}: `shapeplan analyze` takes one DATASET; "
                         "pass TRL options as --name value")
    return launch_processes(known)


def launch_processes(known: Any) -> int:
    """The processes `accelerate launch` starts, from its parsed options (`known`): --num_processes, else its
    --config_file's, else the default config's, else one."""
    if known.num_processes is not None:
        if known.num_processes < 1:
            raise UsageError(f"--num_processes must be at least 1, got {known.num_processes}")
        return int(known.num_processes)
    if known.config_file:
        return int(read_config(known.config_file).get("num_processes", 1) or 1)
    default = Path.home() / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"
    return int(read_config(str(default)).get("num_processes", 1) or 1) if default.is_file() else 1


def split_dataset_argument(spec: TrainerSpec, tokens: Sequence[str]) -> tuple[str | None, list[str]]:
    """Find the positional DATASET among TRL options and the `accelerate launch` options TRL passes through: the
    first bare token that is no option's value."""
    from accelerate.commands.launch import launch_command_parser

    # TRL's own option first where both parsers know a name
    actions = {**launch_command_parser()._option_string_actions, **make_parser(spec)._option_string_actions}
    rest = list(tokens)
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "--config":
            i += 2
            continue
        if token.startswith("-") and token != "-":
            action = _known_action(spec.name, token.split("=", 1)[0], actions)
            if "=" in token or action.nargs == 0:
                i += 1
            elif action.nargs == "?":
                nxt = rest[i + 1] if i + 1 < len(rest) else None
                i += 2 if nxt is not None and nxt.lower() in _BOOL_WORDS else 1
            elif action.nargs in ("+", "*"):
                i += 1
                while i < len(rest) and not rest[i].startswith("-"):
                    i += 1
            else:
                i += 2
            continue
        return token, rest[:i] + rest[i + 1:]
    return None, rest


# The shapeplan command being run and its own options (`--model`, `--split`, `-o`, ...), set by the CLI around the
# command (`own_options`): an unknown option's hint looks among them first, so `--modle` is shapeplan's `--model`,
# not accelerate's `--module`.
_OWN_OPTIONS: ContextVar[tuple[str, tuple[str, ...]]] = ContextVar("shapeplan_own_options", default=("", ()))


@contextmanager
def own_options(command: str, names: Sequence[str]) -> Iterator[None]:
    """While the `shapeplan <command>` runs: its own option names, for the unknown-option hint."""
    token = _OWN_OPTIONS.set((command, tuple(names)))
    try:
        yield
    finally:
        _OWN_OPTIONS.reset(token)


def _known_action(method: str, option: str, actions: dict[str, Any], *, config: str | None = None) -> Any:
    """The action of `option` among TRL's and `accelerate launch`'s (`actions`: both), an unambiguous prefix too (as
    TRL's parser allows it); an unknown option is refused, naming the nearest known one when there is one:
    shapeplan's own first, then TRL's and accelerate's. `config`: the option is a key of that `--config` file."""
    import difflib

    if option in actions:
        return actions[option]
    prefixed = [name for name in actions if name.startswith(option)] if option.startswith("--") else []
    if len(prefixed) == 1 and config is None:  # a YAML key is matched whole, as TRL matches it
        return actions[prefixed[0]]
    if config is not None:
        key = option[2:]
        nearest = difflib.get_close_matches(key, [name[2:] for name in actions if name.startswith("--")], n=1,
                                            cutoff=0.75)
        hint = f"did you mean {nearest[0]}? " if nearest else ""
        raise UsageError(f"unknown key {key!r} in {config}: {hint}it is neither a TRL `{method}` option nor an "
                         f"`accelerate launch` option; fix the key in {config} (see `trl {method} --help`)")
    command, own = _OWN_OPTIONS.get()
    mine = difflib.get_close_matches(option, [name for name in own if name.startswith("--")], n=1, cutoff=0.75)
    if mine:
        raise UsageError(f"unknown option {option!r}: did you mean {mine[0]}, `shapeplan {command}`'s own option? "
                         f"see `shapeplan {command} --help`")
    nearest = difflib.get_close_matches(option, [name for name in actions if name.startswith("--")], n=1, cutoff=0.75)
    hint = f"did you mean {nearest[0]}? " if nearest else ""
    raise UsageError(f"unknown option {option!r}: {hint}it is neither a TRL `{method}` option nor an `accelerate "
                     f"launch` option; see `trl {method} --help`")


def split_run_arguments(spec: TrainerSpec, trl_args: Sequence[str], model: str | None,
                        split: str | None) -> list[str]:
    """TRL's argv for the run: DATASET becomes --dataset_name, --model --model_name_or_path, --split the train split.
    Each overrides what a `--config` file sets, as TRL's own options on the command line do."""
    dataset, argv = split_dataset_argument(spec, trl_args)
    given = given_options(argv, config=False)
    sugar = [("DATASET", dataset, "dataset_name"), ("--model", model, "model_name_or_path"),
             ("--split", split, "dataset_train_split")]
    prefix: list[str] = []
    for label, value, name in sugar:
        if value is None:
            continue
        if name in given:
            raise UsageError(f"both {label} and --{name} are given; pass only one")
        prefix += [f"--{name}", value]
    return prefix + argv


_BOOL_WORDS = {"true", "false", "yes", "no", "t", "f", "y", "n", "1", "0", "none"}
