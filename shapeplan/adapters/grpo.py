"""GRPO and RLOO: prompt lengths from TRL's own `_tokenize_prompts`, the order from TRL's own `RepeatSampler`,
and the generation settings as the trainer builds them, into `plan_generation`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import DatasetError, UsageError
from ..plan.grpo import GenerationLayout, plan_generation
from ..plan.model import Plan
from ..trainers import trainer_spec
from .common import load_run_data, recorded_config, run_fingerprint, versions
from .loop import eval_steps_of, sampled_epochs, train_loop
from .sampling import RankBatches, ordered_batches
from .trl_args import TrainingArgs, make_parser, parse_training_args

# Options the analyze command sets from DATASET, --model and --split: they choose data, not training.
_RUN_OPTIONS = {"dataset_name", "model_name_or_path", "dataset_train_split"}
_TOKENIZE_CHUNK = 1000


def with_guide_example(args: TrainingArgs, argv: list[str]) -> tuple[TrainingArgs, list[str]]:
    """`args`, or the guide's example (`TrainerSpec.guide_options`) when no TRL training option (and no --config)
    is given; plus a note."""
    example = trainer_spec(args.method).guide_options
    if not example or "--config" in argv:
        return args, []
    trl_options = {action.dest for action in make_parser(args.method)._actions}
    if (args.given & trl_options) - _RUN_OPTIONS:
        return args, []
    example_args = parse_training_args(args.method, [*example, *argv])
    note = (f"no training option given: planned TRL's Trainium guide {args.method.upper()} example "
            f"({' '.join(example)}); pass TRL options to plan your own run")
    return example_args, [note]


def _check_supported(args: TrainingArgs) -> list[str]:
    """Refuse what planning cannot follow; warnings for what it plans without some of the run's shapes."""
    config = args.training
    if config.use_vllm:
        raise UsageError("use_vllm=True is not planned: vLLM does not run on Neuron; drop --use_vllm to generate "
                         "with transformers")
    if config.use_transformers_continuous_batching:
        raise UsageError("use_transformers_continuous_batching=True is not planned (its batches follow memory, "
                         "not the config); drop it and pass --cache_implementation static")
    if getattr(args.script, "dataset_streaming", False):
        raise UsageError("dataset_streaming=True replaces TRL's RepeatSampler with a buffered shuffle that "
                         "planning cannot replay; drop --dataset_streaming")
    warnings = []
    reward_model = getattr(args.script, "reward_model_name_or_path", None)
    if reward_model:
        warnings.append(f"reward model {reward_model} is not planned: TRL feeds it re-tokenized prompt+completion "
                        "text without pad_to_multiple_of, (generation batch, exact longest length), a new shape "
                        "almost every round; wrap it in a Python reward function (--reward_funcs) that pads to a "
                        "multiple of 128, or runs it on CPU")
    if getattr(config, "top_entropy_quantile", 1.0) < 1.0:
        warnings.append("top_entropy_quantile < 1 gathers a data-dependent number of entropies each step; those "
                        "small shapes are not planned")
    return warnings


def _generation_settings(config: Any) -> Any:
    """The `GenerationConfig` the trainer builds (the options that size `generate`; sampling ones do not)."""
    from transformers import GenerationConfig

    kwargs = {"max_new_tokens": config.max_completion_length, "cache_implementation": config.cache_implementation}
    kwargs.update(config.generation_kwargs or {})
    try:
        generation = GenerationConfig(**kwargs, disable_compile=True)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"invalid generation_kwargs: {str(exc).strip().splitlines()[0]}") from exc
    if max(generation.num_beams or 1, generation.num_return_sequences or 1) != 1 \
            or generation.prefill_chunk_size is not None:
        raise UsageError("generation_kwargs with num_beams, num_return_sequences or prefill_chunk_size is not "
                         "planned; drop them from --generation_kwargs")
    return generation


def _bare_trainer(method: str, tokenizer: Any, config: Any) -> Any:
    """A trainer with only the attributes `_tokenize_prompts` reads, set as `__init__` sets them for a text model."""
    trainer_class = trainer_spec(method).trainer()
    trainer = trainer_class.__new__(trainer_class)
    trainer.processing_class = tokenizer
    trainer._is_vlm = False
    trainer.environment_factories = None
    trainer.tools = []
    trainer.chat_template = None
    trainer.chat_template_kwargs = config.chat_template_kwargs or {}
    return trainer


def prompt_lengths(dataset: Any, trainer: Any, name: str) -> tuple[int, ...]:
    """Token counts of every row's prompt, tokenized by the trainer's own `_tokenize_prompts` (never truncated)."""
    if "prompt" not in dataset.column_names:
        raise DatasetError(f"the {name} dataset has no 'prompt' column (it has {', '.join(dataset.column_names)}); "
                           "GRPO, RLOO and Distillation generate from 'prompt': rename the column or pass another "
                           "dataset")
    prompts = dataset["prompt"]
    lengths: list[int] = []
    for start in range(0, len(prompts), _TOKENIZE_CHUNK):
        try:
            ids, _, _ = trainer._tokenize_prompts(list(prompts[start:start + _TOKENIZE_CHUNK]))
        except Exception as exc:  # the tokenizer raises many types for unusable prompts
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DatasetError(f"cannot tokenize the {name} prompts: {message}") from exc
        lengths.extend(len(row) for row in ids)
    return tuple(lengths)


def _train_batches(args: TrainingArgs, num_rows: int, steps: int, size: int) -> Callable[[int], RankBatches]:
    """epoch -> per-rank generation batches: `RepeatSampler` draws one permutation per epoch from one generator."""
    from trl.trainer.utils import RepeatSampler

    config = args.training
    sampler = RepeatSampler(range(num_rows), mini_repeat_count=config.num_generations,
                            batch_size=size // config.num_generations,
                            repeat_count=config.num_iterations * steps, shuffle=config.shuffle_dataset,
                            seed=config.seed)
    return sampled_epochs(args, sampler, config.per_device_train_batch_size * steps)


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    args, notes = with_guide_example(args, argv)
    warnings = notes + _check_supported(args)
    config = args.training
    method = args.method
    generation = _generation_settings(config)
    # Parsed with the run's process count (see trl_args), so these are the run's.
    steps, size = config.steps_per_generation, config.generation_batch_size
    n = args.num_processes
    data = load_run_data(args, eval_source=eval_source)
    tokenizer = data.tokenizer
    trainer = _bare_trainer(method, tokenizer, config)
    train_lengths = prompt_lengths(data.train, trainer, "train")
    epoch_batches = _train_batches(args, len(train_lengths), steps, size)
    loop = train_loop(args, epoch_batches)
    if loop.steps_in_epoch == 0:
        raise DatasetError(f"the train dataset has {len(train_lengths)} prompts, fewer than one generation batch "
                           f"holds ({size // config.num_generations} unique prompts); add prompts or lower the batch")

    # GRPO needs old log-probs only when generation and optimizer steps are misaligned; RLOO always computes them.
    old_logprob = method == "rloo" or config.gradient_accumulation_steps % (steps * config.num_iterations) != 0
    ref = config.beta != 0.0
    round_forwards = ("old_logprob",) * old_logprob + ("ref",) * ref
    eval_forwards = ("eval",) + ("eval",) * old_logprob + ("ref",) * ref
    layout = GenerationLayout(
        batch_size=config.per_device_train_batch_size,
        steps_per_generation=steps,
        num_iterations=config.num_iterations,
        pad_to_multiple_of=config.pad_to_multiple_of,
        max_new_tokens=generation.max_new_tokens,
        static_cache=generation.cache_implementation in _static_caches() and generation.use_cache is not False,
        max_cache_len=generation.max_cache_len,
        round_forwards=round_forwards,
        eval_batch_size=config.per_device_eval_batch_size,
        eval_forwards=eval_forwards,
    )

    eval_lengths: tuple[int, ...] = ()
    eval_order: RankBatches = []
    eval_at: list[int] = []
    if data.eval is not None:
        from trl.trainer.utils import RepeatSampler

        eval_lengths = prompt_lengths(data.eval, trainer, "eval")
        generations = config.num_generations_eval or config.num_generations
        # A fresh sampler per evaluation, seeded alike: every evaluation walks the same order.
        order = list(RepeatSampler(range(len(eval_lengths)), mini_repeat_count=generations, seed=config.seed))
        eval_order = ordered_batches(order, batch_size=config.per_device_eval_batch_size, num_processes=n,
                                     drop_last=config.dataloader_drop_last)
        eval_at = eval_steps_of(args, loop)

    recorded = recorded_config(args, argv)
    recorded.update(max_new_tokens=generation.max_new_tokens, max_cache_len=generation.max_cache_len,
                    num_generations_eval=config.num_generations_eval, shuffle_dataset=config.shuffle_dataset)
    return plan_generation(
        method=method,
        prompt_lengths=train_lengths,
        layout=layout,
        loop=loop,
        epoch_batches=epoch_batches,
        eval_prompt_lengths=eval_lengths,
        eval_batches=eval_order,
        eval_steps=eval_at,
        generation_kwargs=config.generation_kwargs or {},
        config=recorded,
        versions=versions(),
        fingerprint=run_fingerprint(data),
        warnings=warnings,
    )


def _static_caches() -> tuple[str, ...]:
    from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

    return tuple(ALL_STATIC_CACHE_IMPLEMENTATIONS)
