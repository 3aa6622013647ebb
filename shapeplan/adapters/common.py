"""What every method's adapter shares: loading the run's datasets and tokenizer, versions, the recorded config."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import DatasetError, UsageError, first_line
from .data import (
    check_rows,
    check_text_only,
    load_dataset_source,
    load_tokenizer,
    select_split,
    tokenizer_fingerprint,
)
from .host import installed_only
from .trl_args import TrainingArgs

# The options recorded in a plan: what shapes the graphs, as TRL names them (values only if the config has them).
RECORDED_OPTIONS = (
    "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "max_length",
    "packing", "packing_strategy", "padding_free", "eval_packing", "num_train_epochs", "max_steps", "seed",
    "data_seed", "train_sampling_strategy", "dataloader_drop_last", "eval_strategy", "eval_steps", "bf16", "fp16",
    "torch_compile", "gradient_checkpointing", "completion_only_loss", "assistant_only_loss", "num_generations",
    "steps_per_generation", "generation_batch_size", "num_iterations", "max_completion_length", "beta",
    "cache_implementation", "generation_kwargs", "precompute_ref_log_probs", "loss_type",
)


@dataclass
class RunData:
    train: Any
    eval: Any | None
    tokenizer: Any
    source: str


def versions() -> dict[str, str]:
    """The versions a plan records."""
    return installed_only(("shapeplan", "trl", "transformers", "accelerate", "datasets", "torch", "torch-neuronx"))


def recorded_config(args: TrainingArgs, argv: list[str]) -> dict[str, Any]:
    return {
        "argv": list(argv),
        # a script's run: the command that builds it (`warm --plan` re-runs it for the script's objects)
        **({"command": list(args.objects.command), "trainer": args.objects.trainer} if args.objects else {}),
        "model_name_or_path": args.model.model_name_or_path,
        "num_processes": args.num_processes,
        # the dtype the model loads in (`trl <method>` passes ModelConfig.dtype unless model_init_kwargs sets it)
        "dtype": (getattr(args.training, "model_init_kwargs", None) or {}).get("dtype", getattr(args.model, "dtype",
                                                                                               None)),
        "attention": attention_facts(args),
        **recorded_options(args.training),
    }


def attention_facts(args: TrainingArgs) -> dict[str, Any]:
    """What decides whether TorchNeuron runs the model's attention through its NKI flash-attention kernel: the
    attention implementation the run loads (None: transformers' default, SDPA), the head dim and the attention
    dropout; and what sizes a static key/value cache: the layers, key/value heads and the checkpoint's dtype (each
    None where the model's config is not readable here)."""
    from transformers import AutoConfig

    kwargs = getattr(args.training, "model_init_kwargs", None) or {}
    implementation = kwargs.get("attn_implementation", getattr(args.model, "attn_implementation", None))
    model = args.objects.model if args.objects is not None else None
    try:
        # the script's model object: its own config, as loaded
        config: Any = model.config if model is not None else AutoConfig.from_pretrained(
            args.model.model_name_or_path or "", revision=args.model.model_revision,
            trust_remote_code=bool(getattr(args.model, "trust_remote_code", False)))
    except (OSError, ValueError):  # planning needs only the tokenizer; the caveat then says it assumed
        return {"implementation": implementation, "head_dim": None, "dropout": None, "layers": None,
                "kv_heads": None, "dtype": None}
    text = getattr(config, "get_text_config", lambda: config)()
    head_dim = getattr(text, "head_dim", None)
    if not isinstance(head_dim, int) and getattr(text, "num_attention_heads", None):
        head_dim = text.hidden_size // text.num_attention_heads
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None)
    return {"implementation": implementation, "head_dim": head_dim,
            "dropout": float(getattr(text, "attention_dropout", 0.0) or 0.0),
            "layers": getattr(text, "num_hidden_layers", None), "kv_heads": heads,
            "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None}


def recorded_options(training: Any) -> dict[str, Any]:
    """The RECORDED_OPTIONS a TRL config (SFTConfig, GRPOConfig, ...) has, as a plan records them."""
    config: dict[str, Any] = {}
    for name in RECORDED_OPTIONS:
        if hasattr(training, name):
            value = getattr(training, name)
            config[name] = value if isinstance(value, (int, float, str, bool, type(None), dict, list)) else str(value)
    return config


def run_fingerprint(data: RunData) -> dict[str, str]:
    """What identifies the plan's inputs: the tokenizer and the datasets' own fingerprints."""
    out = {"tokenizer": tokenizer_fingerprint(data.tokenizer)}
    # A stream (IterableDataset) has no fingerprint: nothing identifies its content without reading it all.
    for name, dataset in (("train_dataset", data.train), ("eval_dataset", data.eval)):
        fingerprint = getattr(dataset, "_fingerprint", None)
        if fingerprint is not None:
            out[name] = fingerprint
    return out


def streamed(args: TrainingArgs) -> bool:
    """Whether the run reads its data as streams (IterableDatasets), as `trl <method>`'s `main()` loads it."""
    return bool(getattr(args.script, "dataset_streaming", False) or getattr(args.dataset_mixture, "streaming", False))


@contextmanager
def trl_preparing(name: str) -> Iterator[None]:
    """TRL's preparation errors (a bad row, a template that fails) as one DatasetError line."""
    from jinja2 import TemplateError

    try:
        yield
    except TemplateError as exc:  # a Jinja syntax error, or a template's own raise_exception
        raise DatasetError(f"the chat template fails on the {name} dataset's rows ({type(exc).__name__}: "
                           f"{first_line(exc)}); fix the template (--chat_template_path, or the model's "
                           "tokenizer_config.json / chat_template.jinja)") from exc
    except TypeError as exc:  # e.g. "can only concatenate str (not "list") to str": text and messages mixed
        raise DatasetError(f"TRL could not prepare the {name} dataset ({first_line(exc)}): its rows mix text with "
                           "lists of messages (a string prompt with a list completion, or rows of two formats); "
                           "give every row one format") from exc
    except (ValueError, RuntimeError, KeyError, AttributeError, IndexError) as exc:
        raise DatasetError(f"TRL could not prepare the {name} dataset: {first_line(exc)}; check that every row has "
                           "the columns and format of the first") from exc


def load_run_data(args: TrainingArgs, *, eval_source: str | None, vision: bool = False) -> RunData:
    """The train (and eval) split and the tokenizer, chosen as `trl <method>`'s `main()` chooses them. With
    --dataset_streaming, IterableDatasets read lazily (every planner streams them). `vision`: the method's planner
    plans image rows (the others refuse them)."""
    if args.objects is not None:
        return _script_data(args, vision=vision)
    script = args.script
    mixture = args.dataset_mixture
    streaming = streamed(args)
    if mixture is not None and getattr(mixture, "datasets", None):
        from trl import get_dataset

        try:
            data = get_dataset(mixture)
        except Exception as exc:  # a mixture can fail in as many ways as load_dataset
            raise DatasetError(f"cannot load the dataset mixture: {exc}; check the `datasets:` entries") from exc
        source = "dataset mixture"
    else:
        source = script.dataset_name
        try:
            data = load_dataset_source(source, name=script.dataset_config, streaming=streaming)
        except DatasetError as exc:
            if "dataset_name" in args.given:
                raise
            # no dataset given: the user may not know this one was chosen for them
            raise DatasetError(f"{exc} (no dataset was given: {source} is `--method {args.method}`'s default, the "
                               "one TRL's Trainium guide uses; pass DATASET to plan your own)") from exc
    train = select_split(data, script.dataset_train_split, source)
    check_rows(train, source)
    if not vision:
        check_text_only(train, source, args.method)

    eval_data = None
    if getattr(args.training, "eval_strategy", "no") != "no":
        if eval_source is not None:
            eval_data = _only_split(load_dataset_source(eval_source, streaming=streaming), script.dataset_test_split,
                                    eval_source)
        elif not isinstance(data, dict) or script.dataset_test_split in data:
            eval_data = select_split(data, script.dataset_test_split, source)
        else:
            raise DatasetError(f"dataset {source} has no split {script.dataset_test_split!r} for the eval loop "
                               f"(it has {', '.join(data)}); pass --eval-dataset DATASET or choose a split with "
                               "--dataset_test_split")
        check_rows(eval_data, eval_source or source)
        if not vision:
            check_text_only(eval_data, eval_source or source, args.method)
    elif eval_source is not None:
        raise UsageError("--eval-dataset is given but eval_strategy is 'no'; add --eval_strategy steps "
                         "(and --eval_steps N) to plan the eval loop")

    tokenizer = load_tokenizer(
        args.model.model_name_or_path,
        revision=args.model.model_revision,
        trust_remote_code=bool(getattr(args.training, "trust_remote_code", False)),
    )
    return RunData(train=train, eval=eval_data, tokenizer=tokenizer, source=source)


def _script_data(args: TrainingArgs, *, vision: bool) -> RunData:
    """The datasets and processing class a script hands its trainer (script mode), as the trainer takes them."""
    objects = args.objects
    assert objects is not None
    source = f"the train_dataset of {objects.trainer}"
    check_rows(objects.train_dataset, source)
    if not vision:
        check_text_only(objects.train_dataset, source, args.method)
    evaluation = objects.eval_dataset if getattr(args.training, "eval_strategy", "no") != "no" else None
    if evaluation is not None:
        check_rows(evaluation, f"the eval_dataset of {objects.trainer}")
        if not vision:
            check_text_only(evaluation, f"the eval_dataset of {objects.trainer}", args.method)
    # a processor's text side: the vision planners read the image side from the model's id (docs/analyze.md)
    tokenizer = getattr(objects.processing_class, "tokenizer", objects.processing_class)
    if tokenizer is None:  # the trainer loads it from the model's id
        tokenizer = load_tokenizer(args.model.model_name_or_path, revision=args.model.model_revision,
                                   trust_remote_code=bool(getattr(args.training, "trust_remote_code", False)))
    return RunData(train=objects.train_dataset, eval=evaluation, tokenizer=tokenizer, source=source)


def _only_split(data: Any, preferred: str, source: str) -> Any:
    import datasets

    if isinstance(data, (datasets.Dataset, datasets.IterableDataset)):
        return data
    if preferred in data:
        return data[preferred]
    if len(data) == 1:
        return next(iter(data.values()))
    return select_split(data, preferred, source)


def apply_chat_template_path(tokenizer: Any, path: str | None) -> None:
    """Load the run's --chat_template_path into the tokenizer, as TRL's trainers do for a .jinja file."""
    if path is None:
        return
    if path.endswith((".jinja", ".j2")):
        try:
            with open(path, encoding="utf-8") as f:
                tokenizer.chat_template = f.read()
        except OSError as exc:
            raise UsageError(f"cannot read chat template {path}: {exc.strerror}") from exc
        return
    raise UsageError(f"chat_template_path={path!r} clones another model's template and adds tokens, which "
                     "planning does not follow; pass a .jinja file instead")
