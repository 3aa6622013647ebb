"""TRL's own argument parsing: `trl <method>`'s parser and YAML config, plus accelerate's launch options.

shapeplan declares none of TRL's options itself: every `--name value` it does not own goes through
`trl.scripts.<method>.make_parser()` exactly as `trl <method>` parses it, and what TRL leaves over goes
through `accelerate launch`'s parser (for `--num_processes` and friends).
"""

from __future__ import annotations

import enum
import importlib
import math
import re
import sys
import types
import warnings
from argparse import ArgumentTypeError
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError, first_line
from ..plan.io import MAX_BATCH, MAX_SEQ
from .agentic import Agentic, AgenticArguments, load
from .config_file import config_path, materialized, read_config
from .host import cache_root, max_forks, process_count

if TYPE_CHECKING:
    from trl import TrlParser

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
    model: Any  # ModelConfig (a ParsedConfig where `planning_args` read the run)
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
    argv = _with_guide_defaults(spec, argv, given)
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


def _with_guide_defaults(spec: TrainerSpec, argv: list[str], given: set[str]) -> list[str]:
    """`argv` after the guide's values of what it leaves out (Neuron's padding multiple, the guide's model and the
    method's dataset) and what planning needs anywhere (no output dir, no reporting, a CPU)."""
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
    return argv


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
    defaults = _load_defaults(spec)
    if defaults is not None:  # options the defaults file knows, without building TRL's and accelerate's parsers
        known = {name: types.SimpleNamespace(nargs=option["nargs"]) for name, option in defaults.options.items()}
        split = _split_dataset(tokens, known.get)
        if split is not None:
            return split
    from accelerate.commands.launch import launch_command_parser

    # TRL's own option first where both parsers know a name
    actions = {**launch_command_parser()._option_string_actions, **make_parser(spec)._option_string_actions}
    split = _split_dataset(tokens, lambda option: _known_action(spec.name, option, actions))
    assert split is not None  # _known_action refuses an unknown option
    return split


def _split_dataset(tokens: Sequence[str], action_of: Callable[[str], Any]) -> tuple[str | None, list[str]] | None:
    """`split_dataset_argument` with the options' actions from `action_of`; None where it knows an option not."""
    rest = list(tokens)
    i = 0
    while i < len(rest):
        token = rest[i]
        if token == "--config":
            i += 2
            continue
        if token.startswith("-") and token != "-":
            action = action_of(token.split("=", 1)[0])
            if action is None:
                return None
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


# what TRL's parser's `string_to_bool` (trl/scripts/_hf_argparser.py) reads as true and as false
_TRUE_WORDS, _FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")
_BOOL_WORDS = {*_TRUE_WORDS, *_FALSE_WORDS, "none"}


# --- A planned run read without importing TRL's configs ---------------------------------------------------------------
# Importing TRL's config classes imports transformers' TrainingArguments and with it peft and transformers' modelling
# code: seconds, before the first row is read. A run that is only planned and names nothing but options TRL's configs
# take as parsed is read from TRL's own parse of the guide's defaults, made once (`keep_defaults`, after `shapeplan
# analyze` planned a run through TRL's parser) and kept under the cache root, with the run's values put in
# (`planning_args`). TRL stays the source of every value: the file holds what its parser and configs made, and what
# the file does not hold is read from TRL's own parse of the run, on first use.

# The options TRL's configs keep as parsed, by the method's config class: no __post_init__ reads, changes or checks
# them (transformers' TrainingArguments, TRL's _BaseConfig, SFTConfig and ModelConfig; ScriptArguments has none), but
# pad_to_multiple_of, converted as SFTConfig.__post_init__ converts it (`_padding_multiple`).
_PLAIN_OPTIONS = {
    "SFTConfig": frozenset({
        "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "model_name_or_path",
        "model_revision", "max_length", "per_device_train_batch_size", "per_device_eval_batch_size",
        "gradient_accumulation_steps", "num_train_epochs", "max_steps", "seed", "data_seed", "packing",
        "packing_strategy", "padding_free", "eval_packing", "dataset_text_field", "shuffle_dataset",
        "dataloader_drop_last", "completion_only_loss", "pad_to_multiple_of",
    }),
}
_DEFAULTS_SCHEMA = 1
# What TRL's parse depends on besides the command line: its config modules and this one (the guide's defaults), by
# path under their package, and the environment TrainingArguments reads.
_TRL_SOURCES = ("__init__.py", "trainer/base_config.py", "trainer/model_config.py", "scripts/utils.py",
                "scripts/_hf_argparser.py")
_TRANSFORMERS_SOURCES = ("__init__.py", "training_args.py", "trainer_pt_utils.py", "trainer_utils.py")
_ENV_PREFIXES = ("ACCELERATE_", "TORCHELASTIC_", "FSDP_")  # TrainingArguments' reads and accelerate's state's
_ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # a value argparse reads after an option, as it reads it
_REFUSED = object()  # a value the defaults cannot answer for: TRL's parser reads the run


@dataclass(frozen=True)
class _Defaults:
    """TRL's parse of the guide's defaults: each config's values and attribute names, in the parser's order
    (ScriptArguments, the method's config, ModelConfig, ...), and the plain options' actions by option string."""

    parts: tuple[tuple[dict[str, Any], frozenset[str]], ...]
    options: dict[str, dict[str, Any]]


class _RunParse:
    """TRL's own parse of a run's argv, made on the first read of an attribute the defaults file does not hold."""

    def __init__(self, spec: TrainerSpec, argv: list[str]) -> None:
        self.spec, self.argv = spec, argv
        self._parts: tuple[Any, ...] | None = None

    def part(self, index: int) -> Any:
        if self._parts is None:
            args = parse_training_args(self.spec, self.argv)
            self._parts = (args.script, args.training, args.model, args.dataset_mixture)
        return self._parts[index]


class ParsedConfig:
    """One config of TRL's parse (ScriptArguments, SFTConfig, ModelConfig, ...) as the defaults file holds it, with
    the run's options put in; an attribute the file names but does not hold (a property, a value with no JSON form)
    is read from TRL's own parse of the run."""

    def __init__(self, values: dict[str, Any], names: frozenset[str], parse: _RunParse, index: int) -> None:
        self.__dict__.update(values)
        self.__dict__["_shapeplan_source"] = (names, parse, index)

    def __getattr__(self, name: str) -> Any:
        source = self.__dict__.get("_shapeplan_source")
        if source is None or name.startswith("__") or name not in source[0]:
            raise AttributeError(name)
        return getattr(source[1].part(source[2]), name)


def planning_args(spec: TrainerSpec, argv: Sequence[str]) -> TrainingArgs:
    """`parse_training_args` for a run that is only planned (its configs are read, never handed to a trainer): from
    the defaults file where the run names only options TRL keeps as parsed, else TRL's parse."""
    argv = list(argv)
    defaults = _load_defaults(spec)
    if defaults is not None:
        args = _read_plain(spec, argv, defaults)
        if args is not None:
            return args
    return parse_training_args(spec, argv)


def keep_defaults(spec: TrainerSpec) -> None:
    """Once a run is planned: where this process read it through TRL's parser and the defaults file is missing, TRL's
    parse of the defaults written as the defaults file, for the next run (never TRL's import for it alone, nor a
    file for a run refused)."""
    if spec.config_class in _PLAIN_OPTIONS and "transformers.training_args" in sys.modules and \
            _load_defaults(spec) is None:
        _store_defaults(spec)


def _read_plain(spec: TrainerSpec, argv: list[str], defaults: _Defaults) -> TrainingArgs | None:
    """The run `argv` names, from `defaults`; None where an option is not a plain one or a value is not one TRL
    reads as the defaults can (TRL's parser then reads the run, and refuses what it refuses)."""
    values = [dict(part_values) for part_values, _ in defaults.parts]
    words = _auto_means_neuron(argv)
    raw: str | None
    i = 0
    while i < len(words):
        name, equals, inline = words[i].partition("=")
        option = defaults.options.get(name)
        if option is None:
            return None
        following = words[i + 1] if i + 1 < len(words) else None
        takes = following is not None and (not following.startswith("-") or bool(_NEGATIVE_NUMBER.match(following)))
        if equals:
            raw, i = inline, i + 1
        elif takes:
            raw, i = following, i + 2
        elif option["nargs"] == "?":
            raw, i = None, i + 1
        else:
            return None
        value = _converted(option, raw)
        if value is _REFUSED:
            return None
        values[option["part"]][option["dest"]] = value
    parse = _RunParse(spec, argv)
    configs = [ParsedConfig(part, names, parse, index)
               for index, (part, (_, names)) in enumerate(zip(values, defaults.parts, strict=True))]
    script, training, model, *rest = configs
    _check_positive(training)
    _check_peft(model)
    given = given_options(argv)
    return TrainingArgs(spec=spec, script=script, training=training, model=model,
                        dataset_mixture=rest[0] if rest else None, given=frozenset(given), agentic=load(None, given))


def _converted(option: dict[str, Any], raw: str | None) -> Any:
    """`raw` as TRL's parser converts it for `option` (its probed kind) and its config keeps it; `_REFUSED` where
    the parser would refuse it or the defaults cannot tell."""
    if raw is None:
        return option["const"]
    if option["none"] and raw.lower() in ("none", "null"):
        return None
    try:
        value = _CONVERTERS[option["kind"]](raw)
    except ValueError:
        return _REFUSED
    if option["choices"] is not None and value not in option["choices"]:
        return _REFUSED
    if isinstance(value, float) and not math.isfinite(value):
        return _REFUSED  # TRL's parse, whose checks name the option
    return _padding_multiple(value) if option["dest"] == "pad_to_multiple_of" else value


def _string_to_bool(word: str) -> bool:
    """TRL's parser's `string_to_bool` (trl/scripts/_hf_argparser.py)."""
    if word.lower() in _TRUE_WORDS:
        return True
    if word.lower() in _FALSE_WORDS:
        return False
    raise ValueError(word)


_CONVERTERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str, "bool": _string_to_bool}


def _padding_multiple(value: Any) -> Any:
    """pad_to_multiple_of as SFTConfig.__post_init__ converts the parser's string ("auto", already the Neuron
    multiple here, depends on the device: TRL's parse reads it)."""
    if not isinstance(value, str) or value == "auto":
        return _REFUSED
    if value.lower() in ("none", "null"):
        return None
    try:
        return int(value)
    except ValueError:
        return _REFUSED


def _defaults_path(spec: TrainerSpec) -> Path:
    """The defaults file of `spec`'s method, named after everything TRL's parse of the defaults depends on."""
    import hashlib
    import importlib.util
    import json
    import os

    sources: dict[str, Any] = {"shapeplan": _signature(Path(__file__))}
    for package, paths in (("trl", (*_TRL_SOURCES, f"trainer/{spec.name}_config.py",
                                    f"scripts/{spec.script.rsplit('.', 1)[-1]}.py")),
                           ("transformers", _TRANSFORMERS_SOURCES)):
        found = importlib.util.find_spec(package)  # a top-level package's spec, found without importing it
        root = Path(found.origin).parent if found is not None and found.origin else None
        sources.update({f"{package}/{path}": _signature(root / path) if root else None for path in paths})
    material = {
        "schema": _DEFAULTS_SCHEMA, "method": spec.name, "python": list(sys.version_info[:2]),
        "argv": _with_guide_defaults(spec, [], set()), "sources": sources,
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES},
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / "trl-defaults" / f"{spec.name}-{digest}.json"


class _Member(str, enum.Enum):
    """The base of `_enum_member`'s enums, which pickle as their value (their class is no module's to import)."""

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return str, (self.value,)


def _enum_member(class_name: str, name: str, value: str) -> Any:
    """A str-valued enum member of TRL's configs (`IntervalStrategy.NO`) without its module (transformers'
    trainer_utils imports peft): a member of an enum of the same name, with the same name and value, equal to its
    value and printed alike (`_decoded` checks); where it is not, TRL's parse gives the value."""
    enumeration = _Member(class_name, [(name, value)])  # type: ignore[call-overload]  # the functional API, not str's
    return getattr(enumeration, name)


def _signature(path: Path) -> tuple[str, int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return str(path), stat.st_mtime_ns, stat.st_size


def _load_defaults(spec: TrainerSpec) -> _Defaults | None:
    """The defaults file of `spec`'s method, or None: none yet, unreadable, or another method's TRL."""
    import json

    if spec.config_class not in _PLAIN_OPTIONS:
        return None
    try:
        data = json.loads(_defaults_path(spec).read_text(encoding="utf-8"))
        parts = tuple((_decoded(part["values"]), frozenset(part["names"])) for part in data["parts"])
        return _Defaults(parts=parts, options=dict(data["options"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store_defaults(spec: TrainerSpec) -> None:
    """TRL's parse of the guide's defaults, written as the defaults file (where the cache root can be written: a
    file not written only costs the next run TRL's import)."""
    import json

    from ..plan.io import write_atomic

    try:
        args = parse_training_args(spec, [])
    except UsageError:  # a host where the defaults do not parse (its environment): every run goes through TRL
        return
    configs = (args.script, args.training, args.model, args.dataset_mixture)
    parser = make_parser(spec)
    owners = {item.name: index for index, config_type in enumerate(parser.dataclass_types)
              for item in fields(config_type)}
    options = {}
    for action in parser._actions:
        if action.dest in _PLAIN_OPTIONS[spec.config_class] and action.dest in owners:
            options.update({name: _option_record(action, owners[action.dest]) for name in action.option_strings})
    record = {"schema": _DEFAULTS_SCHEMA, "options": options,
              "parts": [{"values": _encoded(vars(config)),
                         "names": sorted(name for name in dir(config) if not name.startswith("__"))}
                        for config in configs if config is not None]}
    path = _defaults_path(spec)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, sort_keys=True) + "\n")
    except OSError:
        return


def _option_record(action: Any, part: int) -> dict[str, Any]:
    """An option's action as `_converted` reads it: its value's kind and whether "none" is None, probed through the
    parser's own converter."""
    convert = action.type or str
    kind = type(convert("1")).__name__
    try:
        none = convert("none") is None
    except (ValueError, TypeError, ArgumentTypeError):
        none = False
    return {"dest": action.dest, "part": part, "nargs": action.nargs, "const": action.const, "kind": kind,
            "none": none, "choices": list(action.choices) if action.choices is not None else None}


def _encoded(values: dict[str, Any]) -> dict[str, Any]:
    """A config's attribute values in JSON: plain values as they are, str-valued enum members and nested
    dataclasses (AcceleratorConfig) tagged; what JSON cannot give back as it was is left out (read from TRL)."""
    import dataclasses
    import json

    out: dict[str, Any] = {}
    for name, value in values.items():
        if name.startswith("_"):
            continue
        if isinstance(value, enum.Enum) and isinstance(value, str):
            out[name] = {"enum": [type(value).__name__, value.name, value.value], "str": str(value),
                         "repr": repr(value)}
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            inner = {item.name: getattr(value, item.name) for item in dataclasses.fields(value)}
            if _round_trips(inner):
                out[name] = {"namespace": inner}
        elif _round_trips(value):
            out[name] = {"value": json.loads(json.dumps(value))}
    return out


def _round_trips(value: Any) -> bool:
    """Whether JSON gives `value` back equal and of the same types throughout."""
    if value is None or type(value) in (bool, int, str):
        return True
    if type(value) is float:
        return math.isfinite(value)
    if type(value) is list:
        return all(_round_trips(item) for item in value)
    if type(value) is dict:
        return all(type(key) is str and _round_trips(item) for key, item in value.items())
    return False


def _decoded(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, tagged in values.items():
        if "enum" in tagged:
            member = _enum_member(*tagged["enum"])
            if str(member) == f"{member}" == tagged["str"] and repr(member) == tagged["repr"]:
                out[name] = member
        elif "namespace" in tagged:
            out[name] = types.SimpleNamespace(**tagged["namespace"])
        else:
            out[name] = tagged["value"]
    return out
