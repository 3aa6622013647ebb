"""Agentic GRPO: the tools, environments and custom rollouts `GRPOTrainer` takes as Python objects, which no `trl`
command line passes. shapeplan names them as `module:attr` (or TRL's `--reward_funcs` form, `module.attr`, the
module imported with the working directory on `sys.path` as TRL imports reward functions), or takes the objects
themselves (`shapeplan.analyze(..., tools=[...])`), and sets them on the planning trainer as `GRPOTrainer.__init__`
does (trl/trainer/grpo_trainer.py:656-779): the tool list, each environment's public methods, and the
prefix-preserving training chat template where the model's is not one. The prompts are then rendered by the
trainer's own `_tokenize_prompts`, schemas included.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DatasetError, UsageError, first_line
from ..plan.buckets import round_up
from ..plan.grpo import GenerationLayout, ToolLoop
from .user_code import name_of, user_code


@dataclass
class AgenticArguments:
    """The options `trl grpo` cannot take on its command line; shapeplan adds them to TRL's parser (and `--config`
    YAML keys of the same names)."""

    tools: list[str] | None = field(default=None, metadata={
        "help": "The run's `tools=`: `module:attr` names of functions (or of a list of them), imported with the "
                "working directory on sys.path, as TRL imports --reward_funcs."})
    environment_factory: str | None = field(default=None, metadata={
        "help": "The run's `environment_factory=`: `module:attr` of a callable that returns an environment (or of a "
                "dict of them by the dataset's `environment` column)."})
    rollout_func: str | None = field(default=None, metadata={
        "help": "The run's `rollout_func=` (`module:attr`): run on each batch of prompts with the trainer's "
                "_generate_single_turn answering the shortest and the longest completions, to bound its shapes."})
    # True by default so that a bare `--pad_tool_turns` parses; `load` tells the default from a value given
    pad_tool_turns: bool = field(default=True, metadata={
        "help": "Plan each tool-loop generate padded to the round's rows, one batch size per turn shape (the default "
                "with tools: a ShapeGuard holding the plan pads the run, as does shapeplan.pad_tool_turns(trainer)); "
                "false plans the run unpadded, a batch size for each number of rows that can call a tool."})
    pin_cache: bool = field(default=True, metadata={
        "help": "Plan a run with tools or a rollout function whose static cache is pinned at the longest length any "
                "of its generate calls needs, one cache length for every call (the default with them: a ShapeGuard "
                "holding the plan pins the run; without one, pass the max_cache_len the plan names in "
                "--generation_kwargs); false plans the unpinned run, whose later calls can meet each prompt bucket "
                "at every cache length a call before them grew."})


@dataclass(frozen=True)
class Agentic:
    """What the run hands `GRPOTrainer` besides TRL's options: tools, an environment factory, a rollout function."""

    tools: tuple[Callable[..., Any], ...] = ()
    environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None
    rollout_func: Callable[..., Any] | None = None
    pad_tool_turns: bool | None = None  # the run pads its tool turns (`pad_tool_turns`); None: as `pads` says
    pin_cache: bool | None = None  # the run pins its static cache (`pin_cache`); None: as `pins` says

    def __bool__(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None or self.rollout_func is not None

    @property
    def tool_loop(self) -> bool:
        """Whether the trainer runs its tool loop: it has tools, its own or an environment's."""
        return bool(self.tools) or self.environment_factory is not None

    @property
    def pads(self) -> bool:
        """Whether the run pads its tool turns: as set, else wherever it has a tool loop (an unpadded turn can be
        any number of the round's rows, a graph each: on Neuron, tens of 12-minute compiles per turn shape)."""
        return self.tool_loop if self.pad_tool_turns is None else self.pad_tool_turns

    @property
    def pins(self) -> bool:
        """Whether the run pins its static cache at the longest length its calls need: as set, else wherever it
        has a tool loop or a rollout function (whose later calls otherwise meet each bucket at every length a call
        before them grew)."""
        return (self.tool_loop or self.rollout_func is not None) if self.pin_cache is None else self.pin_cache

    def recorded(self) -> dict[str, Any]:
        """What the plan records of them: the names the trainer knows them by."""
        factory = self.environment_factory
        return {"tools": [tool.__name__ for tool in self.tools] or None,
                "environment_factory": (sorted(factory) if isinstance(factory, dict) else name_of(factory))
                if factory is not None else None,
                **({"rollout_func": name_of(self.rollout_func)} if self.rollout_func is not None else {}),
                **({"pad_tool_turns": self.pads} if self.tool_loop else {})}


def resolve(path: str, option: str) -> Any:
    """The object `path` names: `module:attr`, or `module.attr` as TRL's `--reward_funcs` takes it."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise UsageError(f"--{option} {path!r} names no object: write module:attr (a module importable from the "
                         "working directory, and a name in it)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `trl grpo` does for --reward_funcs
    # importing the module runs it: whatever it raises or exits with is its own failure, not a missing module
    with user_code(f"--{option} {path!r}: importing module {module_name!r}",
                   "fix the module so that it imports (the run imports it too)"):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
                raise  # a module it imports is missing
            raise UsageError(f"--{option} {path!r}: cannot import module {module_name!r}: {first_line(exc)}") \
                from exc
    obj: Any = module
    # a module's `__getattr__` (or a property on the way) is the user's code too
    with user_code(f"--{option} {path!r}: reading {attr!r} from module {module_name!r}",
                   "fix the module's __getattr__, or name another object"):
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise UsageError(f"--{option} {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def _names(value: Any, option: str, *, many: bool) -> list[str]:
    """The `module:attr` names an option holds: a command line gives strings, a `--config` YAML file any value."""
    values = value if many and isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, str) for v in values):
        wanted = "a list of module:attr names (strings)" if many else "one module:attr name (a string)"
        raise UsageError(f"{option} is {value!r} in the config file; give it {wanted}")
    return list(values)


def load(arguments: AgenticArguments | None, given: Collection[str] = ()) -> Agentic:
    """The objects the options name; `given`: the options set on the command line or in the config file (a
    `pad_tool_turns` not among them is left to `Agentic.pads`)."""
    if arguments is None:
        return Agentic()
    switches: dict[str, bool | None] = {}
    for name in ("pad_tool_turns", "pin_cache"):
        value = getattr(arguments, name) if {name, f"no_{name}"} & set(given) else None
        if value is not None and not isinstance(value, bool):  # a config file's value is not parsed
            raise UsageError(f"{name} is {value!r} in the config file; set it to true or false")
        switches[name] = value
    tools: list[Callable[..., Any]] = []
    for path in _names(arguments.tools or [], "tools", many=True):
        obj = resolve(path, "tools")
        for tool in (obj if isinstance(obj, (list, tuple)) else [obj]):
            if not callable(tool):
                raise UsageError(f"--tools {path!r} holds {type(tool).__name__} {tool!r}, not a function; name a "
                                 "function or a list of them")
            tools.append(tool)
    factory, rollout = (
        None if value is None or value == "" else resolve(_names(value, option, many=False)[0], option)
        for option, value in (("environment_factory", arguments.environment_factory),
                              ("rollout_func", arguments.rollout_func)))
    return Agentic(tools=tuple(tools), environment_factory=factory, rollout_func=rollout,
                   pad_tool_turns=switches["pad_tool_turns"], pin_cache=switches["pin_cache"])


def check_supported(agentic: Agentic, *, takes: Sequence[str], method: str) -> None:
    """Refuse what the trainer's plans do not take, and settings that need objects the run lacks (a run without
    any passes)."""
    given = [name for name, value in (("tools", agentic.tools), ("environment_factory", agentic.environment_factory),
                                      ("rollout_func", agentic.rollout_func)) if value]
    if agentic.pad_tool_turns and not agentic.tool_loop:
        raise UsageError("--pad_tool_turns pads the tool loop's generate calls, and the run has no tool loop; pass "
                         "its --tools or --environment_factory, or drop --pad_tool_turns")
    if agentic.pin_cache and not (agentic.tool_loop or agentic.rollout_func is not None):
        raise UsageError("--pin_cache pins the cache a tool loop's or a rollout function's generate calls grow, and "
                         "the run has neither; pass its --tools, --environment_factory or --rollout_func, or drop "
                         "--pin_cache")
    for name in given:
        if name not in takes:
            raise UsageError(f"--{name} is not an argument `{method}`'s trainer takes; drop it")
    if agentic.rollout_func is not None and len(given) > 1:
        raise UsageError("--rollout_func with tools or an environment is not planned (the trainer runs its tool loop "
                         "after the function's rollout); plan one of them")
    if agentic.rollout_func is not None and not callable(agentic.rollout_func):
        raise UsageError(f"--rollout_func names {type(agentic.rollout_func).__name__}, not a function of (prompts, "
                         "trainer)")
    factory = agentic.environment_factory
    if factory is not None and not callable(factory) and not (
            isinstance(factory, dict) and all(callable(f) for f in factory.values())):
        raise UsageError(f"--environment_factory names {type(factory).__name__}, not a callable (or a dict of "
                         "callables) that returns an environment")


def setup_trainer(trainer: Any, agentic: Agentic, tokenizer: Any) -> None:
    """Set the attributes `_tokenize_prompts` and `_get_tool_suffix_ids` read, as `GRPOTrainer.__init__` sets them
    for these tools and environments (an environment is built once here, as the trainer probes it)."""
    from trl.chat_template_utils import (
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    standalone = list(agentic.tools)
    factory = agentic.environment_factory
    trainer._multi_environment = isinstance(factory, dict)
    trainer._tokenizer = tokenizer
    trainer.environment_factories = _factories(factory) or None
    trainer.tools = list(standalone)
    if factory is not None:
        trainer._env_tools, trainer._environment_pool = {}, {}
        for name, instance in _probed(factory).items():
            methods = environment_tools(instance, name)
            trainer._env_tools[name] = standalone + methods
            trainer._environment_pool[name] = [instance]
            trainer.tools += [method for method in methods if method not in trainer.tools]
    if not trainer.tools:
        trainer.chat_template = None
        return
    _check_schemas(trainer.tools)
    if not supports_tool_calling(tokenizer):
        raise UsageError("the model's chat template cannot render a tool-calling conversation (user, assistant with "
                         "tool_calls, tool), which GRPOTrainer refuses with tools; use a model whose template does")
    trainer.chat_template = None if is_chat_template_prefix_preserving(tokenizer) \
        else get_training_chat_template(tokenizer)


def environment_tools(instance: Any, name: str | None = None) -> list[Callable[..., Any]]:
    """An environment's tools as GRPOTrainer lists them (grpo_trainer.py:686-702): its public methods but `reset`
    and `get_reward`, listed on its class (getmembers on the instance would evaluate properties); refused without
    the `reset` the trainer calls before each rollout."""
    members = [member for member, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)]
    if "reset" not in members:
        raise UsageError(f"the environment {_env_label(name)} has no reset method: GRPOTrainer requires one (it is "
                         "called before each rollout)")
    return [getattr(instance, member) for member in members
            if member not in ("reset", "get_reward") and not member.startswith("_")]


def probed_tools(agentic: Agentic) -> tuple[list[Callable[..., Any]], int]:
    """The tools a trainer built without the run's data takes in place of the run's (the warm-up's: the trainer
    calls an environment's `reset` with dataset rows it does not have): the standalone tools and the methods of one
    instance of each environment; and how many environment classes own a reward (`get_reward`: one reward column
    each, grpo_trainer.py:706-730)."""
    tools = list(agentic.tools)
    rewarded: set[type] = set()
    for name, instance in _probed(agentic.environment_factory).items():
        if callable(getattr(type(instance), "get_reward", None)):
            rewarded.add(type(instance))
        tools += [method for method in environment_tools(instance, name)
                  if method.__name__ not in {tool.__name__ for tool in tools}]
    _check_schemas(tools)  # before the warm-up builds a trainer: a tool without a schema fails every prompt
    return tools, len(rewarded)


def _factories(factory: Any) -> dict[str | None, Callable[[], Any]]:
    """`environment_factory` as the trainer keys it: by the dataset's `environment` name, or None for the one
    environment every example uses (none without a factory)."""
    return {} if factory is None else factory if isinstance(factory, dict) else {None: factory}


def _probed(factory: Any) -> dict[str | None, Any]:
    """One instance of each environment, as the trainer probes them at init."""
    out = {}
    for name, make in _factories(factory).items():
        with user_code(f"the environment factory {_env_label(name)} ({name_of(make)})",
                       "fix it: GRPOTrainer calls it with no arguments for each environment it needs"):
            out[name] = make()
    return out


def _env_label(name: str | None) -> str:
    return "given" if name is None else repr(name)


def _check_schemas(tools: Sequence[Callable[..., Any]]) -> None:
    """Each tool's JSON schema, as the chat template renders it: a tool without one fails there."""
    from transformers.utils import get_json_schema

    for tool in tools:
        name = getattr(tool, "__name__", None) or name_of(tool)
        # the chat template renders only functions' and methods' schemas (a class, say, fails every prompt)
        if not (inspect.isfunction(tool) or inspect.ismethod(tool)):
            kind = "class" if inspect.isclass(tool) else f"{type(tool).__name__} object"
            raise UsageError(f"tool {name!r}: its schema cannot be built (a {kind}, not a function or method, "
                             "which the chat template renders); pass a function with type hints and a "
                             "Google-style docstring with an Args section, as GRPOTrainer needs")
        try:
            get_json_schema(tool)
        except Exception as exc:  # transformers raises its own error types for undocumented tools
            raise UsageError(f"tool {name!r}: its schema cannot be built "
                             f"({first_line(exc)}); give it type hints and a Google-style docstring with an Args "
                             "section, as GRPOTrainer needs") from exc


def environment_prompts(trainer: Any, rows: Sequence[dict[str, Any]]) -> tuple[list[Any], list[str | None]]:
    """The prompts of `rows` as the trainer generates from them with environments: each row's environment's `reset`
    (called with the row, once) appends its observation to the last message (grpo_trainer.py:2335-2398); and the
    environment of each row."""
    names = [row.get("environment") if trainer._multi_environment else None for row in rows]
    prompts = []
    for row, name in zip(rows, names, strict=True):
        if name not in trainer.environment_factories:
            raise UsageError(f"a row has environment={name!r}, which is not among the environment factories "
                             f"({', '.join(map(repr, trainer.environment_factories))})")
        prompt = row.get("prompt", [{"role": "user", "content": ""}])
        kwargs = {k: v for k, v in row.items() if k != "environment"} if trainer._multi_environment else row
        environment = trainer._environment_pool[name][0]
        label = f"the environment {_env_label(name)}'s reset ({name_of(type(environment))}.reset)"
        with user_code(f"{label} on a row", _RESET):
            observation = environment.reset(**kwargs)
        _check_observation(observation, label)
        if observation is not None:
            if not (isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict)):
                raise DatasetError(f"a row's prompt is a {type(prompt).__name__}, not a list of messages, and "
                                   "GRPOTrainer appends its environment's reset observation to the last message; "
                                   "give the prompts as messages")
            content = prompt[-1]["content"]
            if isinstance(observation, list) and isinstance(content, str):
                content = [{"type": "text", "text": content}]
            if isinstance(observation, str) and isinstance(content, list):
                observation = [{"type": "text", "text": observation}]
            prompt = [*prompt[:-1], {**prompt[-1], "content": content + observation}]
        prompts.append(prompt)
    return prompts, names


# What GRPOTrainer does with `reset` (grpo_trainer.py:2386-2398): calls it with the row's columns, and appends what it
# returns to the prompt's last message.
_RETURN = "return a str, a list of content parts (dicts) or None"
_RESET = ("give reset a **kwargs parameter (GRPOTrainer calls reset(**row) with every column of the row before each "
          f"rollout) and {_RETURN}")


def _check_observation(observation: Any, label: str) -> None:
    """What `reset` returned, as the trainer appends it to a message's content: None, text, or content parts."""
    if observation is None or isinstance(observation, str) or (
            isinstance(observation, list) and all(isinstance(part, dict) for part in observation)):
        return
    shown = repr(observation)
    raise UsageError(f"{label} returned {type(observation).__name__} {shown[:60]}{'...' * (len(shown) > 60)}, "
                     f"which GRPOTrainer cannot append to the prompt's last message; {_RETURN}")


def batch_prompts(trainer: Any, columns: dict[str, list[Any]]) -> list[Any]:
    """The prompts of a batch of rows (`columns`: a column-major slice) as the trainer generates from them: the
    `prompt` column, or with environments each row's after its environment's `reset` (and the trainer's
    `_batch_environments` set, whose tool schemas `_tokenize_prompts` renders)."""
    if trainer.environment_factories is None:
        return list(columns["prompt"])
    rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    prompts, trainer._batch_environments = environment_prompts(trainer, rows)
    return prompts


def tool_loop(trainer: Any, config: Any, *, padded: bool) -> ToolLoop | None:
    """The bound of the trainer's tool loop (`_tool_call_loop`), or None where it does not run; `padded`: the run
    pads each turn to the round's rows."""
    if not trainer.tools:
        return None
    iterations = config.max_tool_calling_iterations
    if iterations == 0:
        return None
    # A turn appends the call (at least one token) and the tool response's formatting (the suffix of an empty
    # response, the shortest over the tools' names: some templates name the tool in it).
    growth = 1 + min(len(trainer._get_tool_suffix_ids([{"role": "tool", "name": tool.__name__, "content": ""}]))
                     for tool in trainer.tools)
    most = config.max_completion_length // growth
    return ToolLoop(turns=most if iterations is None else min(iterations, most), min_growth=growth,
                    max_completion_length=config.max_completion_length, padded=padded)


# A tool turn is planned at every (batch, prompt bucket, cache length) it can meet, each round (plan/grpo.py,
# `_Counting.tool_turns`): with a long max_completion_length and fine buckets that is hundreds of thousands of shapes,
# each a compile of its own, and a replay that exhausts memory. Beyond these the plan is refused before the replay
# (docs/bounds.md), as `loop.MAX_WALK` refuses too long a replay.
MAX_TURN_SHAPES = 100_000  # the shapes a round's tool turns can meet
MAX_TURN_WORK = 50_000_000  # those shapes over every round of the run: about a minute of replay


def check_tool_turns(layout: GenerationLayout, lengths: Sequence[int], *, rows: int, rounds: int,
                     max_steps: int) -> None:
    """Refuse a tool loop whose turns can meet more shapes a round than MAX_TURN_SHAPES, or cost more than
    MAX_TURN_WORK to replay over the run's `rounds` (each of at most `rows` rows; `lengths`: every prompt's), naming
    the settings that bound them."""
    loop = layout.tool_loop
    if loop is None or loop.turns == 0 or not lengths:
        return
    multiple = layout.pad_to_multiple_of or 1
    low = round_up(min(lengths) + loop.min_growth, multiple)
    buckets = range(low, round_up(max(lengths) + loop.max_completion_length, multiple) + 1, multiple)
    # a static cache grows to one more length per bucket that outgrows the pin (CacheLength: a running maximum)
    pin = -1 if layout.max_cache_len is None else layout.max_cache_len
    outgrowing = buckets[max(0, -(-(pin - layout.max_new_tokens + 2 - low) // multiple)):]
    caches = 1 + len(outgrowing) if layout.static_cache and not layout.pin_cache else 1
    batches = 1 if loop.padded else rows
    shapes = len(buckets) * caches * batches
    if shapes <= MAX_TURN_SHAPES and shapes * rounds <= MAX_TURN_WORK:
        return
    fixes = [f"lower --max_completion_length ({loop.max_completion_length})"]
    fixes.append("raise --pad_to_multiple_of" if layout.pad_to_multiple_of else "pad with --pad_to_multiple_of 128")
    if caches > 1:
        fixes.append("pin the cache (--pin_cache true)")
    if batches > 1:
        fixes.append("pad the turns (--pad_tool_turns true)")
    counts = " x ".join(f"{n:,} {word}{'s' * (n != 1)}" for n, word in (
        (len(buckets), "prompt length"), (caches, "cache length"), (batches, "batch size")))
    what = f"the tool turns of a round can meet {shapes:,} generate shapes ({counts})"
    if shapes > MAX_TURN_SHAPES:
        raise UsageError(f"{what}, more than shapeplan plans ({MAX_TURN_SHAPES:,}), each a compile of its own: "
                         f"{', '.join(fixes[:-1])} or {fixes[-1]}")
    fixes.append(f"plan fewer steps (--max_steps{f' {max_steps}' if max_steps > 0 else ''})")
    raise UsageError(f"{what} over {rounds:,} rounds: {shapes * rounds:,} replay steps, more than shapeplan replays "
                     f"({MAX_TURN_WORK:,}); {', '.join(fixes[:-1])} or {fixes[-1]}")
