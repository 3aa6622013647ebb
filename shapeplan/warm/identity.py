"""What every warmer checks and loads the same way: the run's tokenizer, that a plan was made for this run, and the
run's environment (the manifest key)."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from ..adapters.host import installed_versions
from ..adapters.lora import peft_settings
from ..errors import PlanFileError, UsageError
from ..plan.model import GENERATE_PHASES, Plan

if TYPE_CHECKING:
    from ..adapters.trl_args import TrainingArgs


def load_run_tokenizer(args: TrainingArgs) -> Any:
    """The tokenizer of the run's model, loaded as the planning adapters load it (a script's own processing class,
    where it hands the trainer one)."""
    from ..adapters.data import load_tokenizer

    given = script_objects(args).get("processing_class")
    if given is not None:
        return given
    return load_tokenizer(args.model.model_name_or_path, revision=args.model.model_revision,
                          trust_remote_code=bool(args.training.trust_remote_code))


def script_objects(args: TrainingArgs) -> dict[str, Any]:
    """What a script hands its trainer that a warm-up's trainer takes too: its processing class (a tokenizer the
    script configured: the plan was made with it)."""
    processing = args.objects.processing_class if args.objects is not None else None
    return {"processing_class": processing} if processing is not None else {}


def check_plan_identity(plan: Plan, method: str, tokenizer: Any, model: str) -> None:
    """The plan must have been made for this method and this tokenizer."""
    from ..adapters.data import tokenizer_fingerprint

    if plan.method != method:
        raise PlanFileError(f"the plan is for `{plan.method}`, not {method}; pass --method {plan.method}")
    planned = plan.fingerprint.get("tokenizer")
    if planned is not None and planned != tokenizer_fingerprint(tokenizer):
        raise PlanFileError(f"the plan was made with another tokenizer than {model}'s; re-create it with "
                            f"`shapeplan analyze ... --model {model} -o PLAN`")


def check_plan_fits_model(plan: Plan, args: Any, warmer: Any) -> None:
    """Every planned sequence must fit the model's position embeddings (when its config states them), and the
    warm-up must be able to build the run's trainer (a PEFT run: with peft installed) and feed every shape (a vision
    batch: with its rows' layouts, at the processor's patch size: `warmer.processor`, the one the warm-up feeds).
    Checked before the cache dir is made."""
    import importlib.util

    if getattr(args.model, "use_peft", False) and importlib.util.find_spec("peft") is None:
        # TRL asks the same question when it builds the trainer: every shape would fail on it
        raise UsageError("the run trains with --use_peft, and peft is not installed here; install it (`pip install "
                         "peft`) or warm a run without --use_peft")
    if any(s.pixel_values is not None and not s.text_runs for s in plan.shapes):
        raise PlanFileError("the plan's vision batches lack their rows' layouts (text_runs), which warm needs to "
                            "feed them (an observed plan, or one made by an older shapeplan); re-create it with "
                            "`shapeplan analyze`")
    _check_pixel_rows(plan, args, warmer)
    _check_generate_settings(plan)
    beyond = beyond_position_embeddings(plan, args)
    if beyond is not None:
        raise PlanFileError(f"{beyond}; re-create the plan with a --max_length that fits")


def _check_generate_settings(plan: Plan) -> None:
    """warm drives every `generate` with the trainer's GenerationConfig: a rollout function's own calls of the
    model's `generate` at another max_new_tokens (planned with it) would be warmed as other shapes than it names."""
    expected = plan.config.get("max_new_tokens")
    other = sorted({s.max_new_tokens for s in plan.shapes if s.phase in GENERATE_PHASES
                    and s.max_new_tokens is not None and s.max_new_tokens != expected})
    if expected is not None and other:
        raise PlanFileError(f"the plan's rollout function calls generate with max_new_tokens {other}, and warm drives "
                            f"generate at the trainer's ({expected}), so it would warm other shapes; give the "
                            "function's calls the trainer's max_completion_length, or warm the run without them")


def _check_pixel_rows(plan: Plan, args: Any, warmer: Any) -> None:
    """A vision batch's `pixel_values` must be the shape the run's processor makes of its images (each layout's rows
    taking the batch's images in turn): the warm-up feeds images that processor processes, so a plan naming another
    shape (hand-edited, or made for another model) would record as warmed a shape the run never meets."""
    if all(s.pixel_values is None for s in plan.shapes):
        return
    family = warmer.processor.family  # a warmer that feeds images (`check_warmable` refused the others)
    for shape in plan.shapes:
        if shape.pixel_values is None:
            continue
        for layout in shape.text_runs:
            keys, rows = iter(shape.images), []
            for runs in layout:
                rows.append([next(keys) for _ in runs[1:]])
            made = family.pixel_values(rows)
            if made != shape.pixel_values:
                model = args.model.model_name_or_path
                raise PlanFileError(f"the plan's {shape.phase} {shape.batch}x{shape.seq} batch has pixel_values "
                                    f"{list(shape.pixel_values)}, and {model}'s processor makes {list(made)} of its "
                                    "images; re-create the plan with `shapeplan analyze` for this model")


def beyond_position_embeddings(plan: Plan, args: Any) -> str | None:
    """What the plan's longest shape exceeds, when it is longer than the model's max_position_embeddings (as its
    config states them); None when it fits or no config is readable here."""
    from transformers import AutoConfig

    model = args.model.model_name_or_path
    try:
        config = AutoConfig.from_pretrained(model, revision=args.model.model_revision,
                                            trust_remote_code=bool(args.training.trust_remote_code))
    except (OSError, ValueError):  # no readable config here: loading the model reports it, with its own fix
        return None
    limit = getattr(config, "max_position_embeddings", None)
    longest = max(plan.shapes, key=lambda s: s.seq)
    if isinstance(limit, int) and longest.seq > limit:
        return (f"the plan has a {longest.phase} shape of seq {longest.seq}, beyond {model}'s "
                f"max_position_embeddings {limit}")
    return None


# Config fields that never change what is compiled (paths, logging, schedule lengths, data choice, batch sizes,
# which the shapes carry). Everything else enters the config hash: a change there means re-warming.
_NOT_COMPILED = {
    "output_dir", "overwrite_output_dir", "run_name", "report_to", "seed", "data_seed", "num_train_epochs",
    "max_steps", "learning_rate", "resume_from_checkpoint", "disable_tqdm", "do_train", "do_eval", "do_predict",
    "per_device_train_batch_size", "per_device_eval_batch_size", "eval_strategy", "eval_steps", "eval_delay",
    "eval_on_start", "eval_packing", "train_sampling_strategy", "shuffle_dataset", "load_best_model_at_end",
    "metric_for_best_model", "greater_is_better", "ignore_data_skip", "skip_memory_metrics", "dataset_num_proc",
    "dataset_text_field", "dataset_kwargs", "logging_dir", "project", "trackio_space_id", "use_cpu",
}
_NOT_COMPILED_PREFIXES = ("logging_", "save_", "hub_", "push_to_hub", "warmup_", "lr_scheduler", "dataloader_",
                          "include_")
# The section the hashed training config sits under, for every method: the name is part of the manifest key, so
# it stays what the first (SFT) warmer wrote, or every existing cache would stop matching.
_CONFIG_SECTION = "sft"


def environment(args: TrainingArgs) -> dict[str, Any]:
    """What besides the backend shapes the compiled code of the run `args` (its TrainingArgs): method, model,
    dtype, world size, versions and a hash of the config, and a PEFT run's adapter settings (adapters/lora.py), in
    the clear so that `verify` names a mismatch. It keys the manifest: keep its value stable (a run without PEFT
    has no "peft" entry, as before)."""
    config, model_args = args.training, args.model
    values = {k: v for k, v in config.to_dict().items()
              if k not in _NOT_COMPILED and not k.startswith(_NOT_COMPILED_PREFIXES)}
    model = {k: v for k, v in vars(model_args).items() if k != "model_name_or_path"}
    hashed = {_CONFIG_SECTION: values, "model": model}
    peft = peft_settings(model_args)
    return {
        **({"peft": peft} if peft is not None else {}),
        "method": args.method,
        "model": model_args.model_name_or_path,
        "dtype": {"model": str(model_args.dtype), "bf16": bool(config.bf16), "fp16": bool(config.fp16)},
        "world_size": args.num_processes,
        "versions": installed_versions(("torch", "trl", "transformers", "accelerate")),
        "config_hash": hashlib.sha256(json.dumps(hashed, sort_keys=True, default=str).encode()).hexdigest()[:16],
    }
