"""A trainer a script built (`capture.Built`), as the `TrainingArgs` every planner and warmer reads: its config as
the config, its datasets, processing class, model, PEFT config and reward functions as `ScriptObjects`, its tools,
environments and rollout function as `Agentic`, and the launcher's process count."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...errors import UsageError
from ..agentic import Agentic
from ..trl_args import ScriptObjects, TrainingArgs, make_parser, world_size
from .capture import GIVEN, Built, planning_configs
from .command import ScriptCommand

if TYPE_CHECKING:
    from ..trainer import TrainerSpec

# LoraConfig's fields as TRL's ModelConfig names them (`trl.get_peft_config` maps them back)
_LORA_FIELDS = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
                "target_modules": "lora_target_modules", "target_parameters": "lora_target_parameters",
                "modules_to_save": "lora_modules_to_save", "task_type": "lora_task_type",
                "use_rslora": "use_rslora", "use_dora": "use_dora"}


def training_args(spec: TrainerSpec, built: Built, command: ScriptCommand, *, use_cpu: bool = True) -> TrainingArgs:
    """The run `built` (an instance of `spec`'s trainer) trains, for the planners and warmers."""
    from trl import ModelConfig

    arguments = built.arguments
    model = arguments.get("model")
    model_id = _model_id(model, built)
    config = _config(spec, arguments.get("args"), model_id, use_cpu=use_cpu)
    train, evaluation = arguments.get("train_dataset"), arguments.get("eval_dataset")
    _check_data(built, train, evaluation, config)
    _check_collator(built, arguments.get("data_collator"))
    if arguments.get("formatting_func") is not None:
        raise UsageError(f"{built.described} is given a formatting_func, which shapeplan does not replay; apply it "
                         "with dataset.map(...) in the script before the trainer (the rows are then planned as "
                         "mapped)")
    peft = arguments.get("peft_config")
    model_config = ModelConfig(model_name_or_path=model_id, **_peft_fields(peft, built))
    reward_funcs = arguments.get("reward_funcs")
    rewards = tuple(reward_funcs if isinstance(reward_funcs, (list, tuple)) else
                    ([reward_funcs] if reward_funcs is not None else []))
    script = _script_arguments(spec, train, rewards)
    tools = arguments.get("tools") or ()
    agentic = Agentic(tools=tuple(tools), environment_factory=arguments.get("environment_factory"),
                      rollout_func=arguments.get("rollout_func"))
    objects = ScriptObjects(command=command.words, trainer=built.described, train_dataset=train,
                            eval_dataset=evaluation, processing_class=arguments.get("processing_class"),
                            model=None if isinstance(model, str) else model, peft_config=peft, reward_funcs=rewards)
    given = frozenset({f.name for f in dataclasses.fields(config)} | {"model_name_or_path", "dataset_name"})
    return TrainingArgs(spec=spec, script=script, training=config, model=model_config, dataset_mixture=None,
                        num_processes=command.num_processes, given=given, agentic=agentic, objects=objects)


def _model_id(model: Any, built: Built) -> str:
    """The id (Hub id or folder) the trainer's model comes from: the tokenizer, the model's config and a warm-up's
    weights are read from it."""
    if isinstance(model, str):
        return model
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = getattr(getattr(inner, "config", None), "_name_or_path", None) or getattr(inner, "name_or_path", None)
    if not name:
        raise UsageError(f"{built.described} is given a model with no name_or_path (built from a config, not loaded): "
                         "shapeplan reads the model's config and tokenizer from its id; save it with "
                         "save_pretrained and load it from that folder in the script")
    return str(name)


def _config(spec: TrainerSpec, args: Any, model_id: str, *, use_cpu: bool) -> Any:
    """The config the trainer trains with, as its `__init__` makes it: TRL's default for `args=None`, the method's
    config class from a plain `TrainingArguments` (resolved for Trainium, as the script's own were)."""
    from transformers import TrainingArguments

    config_class = spec.config()
    if isinstance(args, config_class):
        return args
    with planning_configs(use_cpu=use_cpu):
        if args is None:
            return config_class(f"{model_id.split('/')[-1]}-{spec.trainer_class.removesuffix('Trainer')}")
        if isinstance(args, TrainingArguments):
            values = args.to_dict()
            values["hub_token"] = args.hub_token  # to_dict hides it
            return config_class(**values)
    raise UsageError(f"the trainer's args is a {type(args).__name__}, not a {config_class.__name__} or "
                     "TrainingArguments; pass the config object")


def _check_data(built: Built, train: Any, evaluation: Any, config: Any) -> None:
    import datasets

    if train is None:
        raise UsageError(f"{built.described} is given no train_dataset; shapeplan plans the rows the trainer trains "
                         "on")
    if not isinstance(train, (datasets.Dataset, datasets.IterableDataset)):
        raise UsageError(f"{built.described}'s train_dataset is a {type(train).__name__}, not a datasets.Dataset or "
                         "IterableDataset, as TRL requires; build it with Dataset.from_list(...) or load_dataset(...)")
    if isinstance(evaluation, dict):
        raise UsageError(f"{built.described}'s eval_dataset is a dict of {len(evaluation)} datasets, which shapeplan "
                         "does not plan yet; pass one eval dataset")
    if evaluation is None and getattr(config, "eval_strategy", "no") != "no":
        raise UsageError(f"{built.described} evaluates (eval_strategy={str(config.eval_strategy)!r}) but is given no "
                         "eval_dataset, which the Trainer refuses; pass one or set eval_strategy='no'")


def _check_collator(built: Built, collator: Any) -> None:
    """A collator of the script's own shapes batches as it likes: refused, but where it is the one the trainer would
    build."""
    if collator is None:
        return
    raise UsageError(f"{built.described} is given its own data_collator ({type(collator).__name__}), whose batch "
                     "shapes shapeplan cannot replay; drop it to let TRL build its own (padding to "
                     "pad_to_multiple_of), or plan the run without it")


def _peft_fields(peft: Any, built: Built) -> dict[str, Any]:
    """The ModelConfig fields of a PEFT config object (`trl.get_peft_config` gives the same LoraConfig back)."""
    if peft is None:
        return {}
    from peft import LoraConfig

    if not isinstance(peft, LoraConfig):
        raise UsageError(f"{built.described} is given a {type(peft).__name__}; shapeplan plans LoRA (LoraConfig) and "
                         "full fine-tuning")
    fields: dict[str, Any] = {"use_peft": True}
    for name, option in _LORA_FIELDS.items():
        value = getattr(peft, name, None)
        if isinstance(value, (set, frozenset)):
            value = sorted(value)
        if option == "lora_task_type" and value is not None:
            value = getattr(value, "value", value)
        if value is not None:
            fields[option] = value
    return fields


def _script_arguments(spec: TrainerSpec, train: Any, rewards: tuple[Any, ...]) -> Any:
    """The method's script arguments as `trl <method>` would hold them for this run: streaming where the train set
    is a stream, the reward functions by name (a model id among them: the reward model)."""
    import datasets

    script_class = next(iter(make_parser(spec).dataclass_types))
    script = script_class(dataset_name=None)
    script.dataset_streaming = isinstance(train, datasets.IterableDataset)
    if hasattr(script, "reward_funcs"):
        models = [r for r in rewards if isinstance(r, str)]
        script.reward_funcs = [getattr(r, "__name__", type(r).__name__) for r in rewards if not isinstance(r, str)]
        if models and hasattr(script, "reward_model_name_or_path"):
            script.reward_model_name_or_path = models[0]
    return script


def with_options(args: TrainingArgs, pairs: Sequence[tuple[str, str]], *, use_cpu: bool = True) -> TrainingArgs:
    """A script's run (`training_args`) with TRL options changed (`--name value` pairs, as `advise`'s what-ifs and
    the untruncated lengths name them): the values typed by TRL's own parser, and the config built again from what
    the script gave it plus them, so that what the config derives (GRPO's generation batch, ...) follows."""
    given = getattr(args.training, GIVEN, None)
    if given is None:
        raise UsageError("this config was not built while shapeplan ran the script; plan the script itself")
    changes = dict(pairs)
    agentic = args.agentic
    # options of shapeplan's, not of the config
    if "pad_tool_turns" in changes:
        agentic = dataclasses.replace(agentic, pad_tool_turns=changes.pop("pad_tool_turns").lower() == "true")
    if "pin_cache" in changes:
        agentic = dataclasses.replace(agentic, pin_cache=changes.pop("pin_cache").lower() == "true")
    if changes:
        words = [word for name, value in changes.items() for word in (f"--{name}", value)]
        with world_size(args.num_processes), planning_configs(use_cpu=True):
            parsed = make_parser(args.spec).parse_args_and_config(
                ["--output_dir", "shapeplan-output", *words], return_remaining_strings=True)
        typed = next(item for item in parsed if isinstance(item, type(args.training)))
        values = {**given, **{name: getattr(typed, name) for name in changes}}
        with world_size(args.num_processes), planning_configs(use_cpu=use_cpu):
            training = type(args.training)(**values)
    else:
        training = args.training
    return dataclasses.replace(args, training=training, agentic=agentic)
