"""What the generating trainers' adapters share (GRPO, RLOO: shapeplan/adapters/grpo.py; Distillation:
shapeplan/adapters/distillation.py): the options planning refuses, the generation settings as the trainer builds
them, prompt lengths from the trainer's own `_tokenize_prompts`, the eval order from TRL's own `RepeatSampler` (or,
for a stream, `shapeplan.adapters.generation_stream`), and the call into `plan_generation`."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import DatasetError, UsageError, first_line
from ..plan.grpo import GenerationLayout, Rollouts, plan_generation
from ..plan.model import Plan
from ..plan.rows import Rows
from ..plan.schedule import TrainLoop
from . import generation_stream
from .common import RunData, run_fingerprint, versions
from .loop import eval_steps_of, sharding
from .sampling import RankBatches, ordered_batches
from .trl_args import TrainingArgs

if TYPE_CHECKING:
    from transformers import GenerationConfig
    from trl import DistillationConfig, GRPOConfig, RLOOConfig

    from .agentic import Agentic
    from .trainer import TrainerSpec

    GenerationTrainingConfig = GRPOConfig | RLOOConfig | DistillationConfig

_TOKENIZE_CHUNK = 1000


def refuse_unplannable(args: TrainingArgs) -> None:
    """Refuse the options whose generation or order planning cannot follow."""
    if args.training.use_vllm:
        raise UsageError("use_vllm=True is not planned: vLLM does not run on Neuron; drop --use_vllm to generate "
                         "with transformers")
    iterations = getattr(args.training, "max_tool_calling_iterations", None)
    if iterations is not None and iterations < 0:  # the trainer would run no tool turn at all, as with 0
        raise UsageError(f"--max_tool_calling_iterations must be 0 or more (or unset: no limit), got {iterations}; "
                         "pass the run's limit of tool-calling turns")
    check_cache_pin(args.training)


def check_cache_pin(config: Any) -> None:
    """A `max_cache_len` in --generation_kwargs must be a cache length: the plan's cache lengths are the largest of it
    and each prompt's, so a string fails the comparison and -1 or 1e30 would be planned without a word."""
    from ..plan.io import MAX_SEQ

    pin = (getattr(config, "generation_kwargs", None) or {}).get("max_cache_len")
    if pin is not None and (type(pin) is not int or not 1 <= pin <= MAX_SEQ):
        raise UsageError(f"--generation_kwargs max_cache_len is {pin!r}, not a cache length from 1 to {MAX_SEQ:,}; "
                         "pass the static cache length in tokens to pin ('{\"max_cache_len\": 1024}'), or drop it")


def pins_cache(agentic: Agentic, layout: GenerationLayout) -> bool:
    """Whether the plan is of a run that pins its static cache at the longest length its calls need
    (`Agentic.pins`: by default with a tool loop or a rollout function, unless the run pins it itself);
    `--pin_cache true` where there is nothing to pin is refused."""
    if agentic.pin_cache and not layout.static_cache:
        raise UsageError("--pin_cache pins a static cache, and the run's is dynamic; pass --cache_implementation "
                         "static, or drop --pin_cache")
    if agentic.pin_cache and layout.max_cache_len is not None:
        raise UsageError(f"--pin_cache pins the cache at the longest length the run needs, and --generation_kwargs "
                         f"already pins it at max_cache_len {layout.max_cache_len}; drop one of them")
    return (agentic.pins and (layout.tool_loop is not None or agentic.rollout_func is not None)
            and layout.static_cache and layout.max_cache_len is None)


def tool_loop_warnings(args: TrainingArgs) -> list[str]:
    """A tool-calling bound with nothing to call: the trainer's tool loop runs only with the trainer's `tools` or
    `environment_factory` (Python objects no `trl` command passes); and a tool loop the plan bounds."""
    iterations = getattr(args.training, "max_tool_calling_iterations", None)
    agentic = args.agentic
    if agentic.tool_loop:
        rows = "padded to the round's rows" if agentic.pads else \
            "on the rows that called a tool, any batch from 1 to the round's rows"
        pinned = agentic.pins or getattr(generation_settings(args.training), "max_cache_len", None) is not None
        pin = "" if pinned else \
            "; pin the cache (--pin_cache true) to keep one cache length"
        return [f"tool calls make shapes the model's answers decide: each round's later generate calls ({rows}) and "
                f"the cache lengths they reach are planned as a bound (certain: false){pin}"]
    if iterations is None:
        return []
    return [f"max_tool_calling_iterations={iterations} is planned without tool calls: the trainer runs its tool "
            "loop only when given tools= or environment_factory=; pass them as --tools module:attr or "
            "--environment_factory module:attr (with them every prompt carries the tool schemas and each call "
            "generates again at a longer cache length)"]


def generation_kwargs(config: Any) -> dict[str, Any]:
    """The run's `generation_kwargs` as a dict (TRL's config accepts the JSON string a command line gives; its
    __post_init__ parses it)."""
    value = getattr(config, "generation_kwargs", None) or {}
    return dict(json.loads(value) if isinstance(value, str) else value)


def generation_settings(config: GenerationTrainingConfig) -> GenerationConfig:
    """The `GenerationConfig` the trainer builds (the options that size `generate`; sampling ones do not)."""
    from transformers import GenerationConfig

    kwargs: dict[str, Any] = {"max_new_tokens": config.max_completion_length,
                              "cache_implementation": config.cache_implementation, **generation_kwargs(config)}
    try:
        generation = GenerationConfig(**kwargs, disable_compile=True)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"invalid generation_kwargs: {first_line(exc)}") from exc
    if max(generation.num_beams or 1, generation.num_return_sequences or 1) != 1 \
            or generation.prefill_chunk_size is not None:
        raise UsageError("generation_kwargs with num_beams, num_return_sequences or prefill_chunk_size is not "
                         "planned; drop them from --generation_kwargs")
    return generation


def generation_configs(args: TrainingArgs, tokenizer: Any) -> tuple[Any, Any]:
    """The run's model's config and generation config, as the trainer's model has them (the pad token the trainer
    mirrors onto it from the tokenizer), which size a rollout function's own `generate` calls; (None, None) where
    they are not readable here."""
    from transformers import AutoConfig, GenerationConfig

    model = args.objects.model if args.objects is not None else None
    if model is not None:  # the script's model object, as loaded
        config, generation = model.config, copy.deepcopy(model.generation_config)
    else:
        path, revision = args.model.model_name_or_path, args.model.model_revision
        try:
            config = AutoConfig.from_pretrained(path or "", revision=revision,
                                                trust_remote_code=bool(args.training.trust_remote_code))
        except (OSError, ValueError):
            return None, None
        try:  # as from_pretrained loads it: the model's generation_config.json, else from its config
            generation = GenerationConfig.from_pretrained(path, revision=revision)
        except OSError:
            generation = GenerationConfig.from_model_config(config)
    generation.pad_token_id = tokenizer.pad_token_id
    return config, generation


def static_cache(generation: GenerationConfig) -> bool:
    """Whether `generate` runs with a static cache (a cache length per size) under these settings."""
    from transformers.generation.configuration_utils import (
        ALL_STATIC_CACHE_IMPLEMENTATIONS,
    )

    return generation.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS and generation.use_cache is not False


class PlanningAccelerator:
    """The planning trainer's `accelerator`, as rank 0 of the run sees it, for what a rollout function reads: where it
    runs, which rank it is, and the model unwrapped (itself)."""

    process_index = local_process_index = 0
    num_processes = 1
    is_main_process = is_local_main_process = True
    state = type("State", (), {"deepspeed_plugin": None, "fsdp_plugin": None})()

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cpu")

    def unwrap_model(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        return model

    def wait_for_everyone(self) -> None:
        return None


def bare_trainer(spec: TrainerSpec, tokenizer: Any, config: GenerationTrainingConfig, agentic: Agentic) -> Any:
    """A trainer of `spec`'s class with only the attributes `_tokenize_prompts` reads, set as `__init__` sets them
    for a text model with `agentic`'s tools and environments."""
    from .agentic import setup_trainer

    trainer_class = spec.trainer()
    trainer = trainer_class.__new__(trainer_class)
    trainer.processing_class = tokenizer
    # what a rollout function reads of a real trainer besides its config (its model: RolloutProbe's dry-run one)
    trainer.accelerator = PlanningAccelerator()
    trainer._is_vlm = False
    trainer.chat_template_kwargs = config.chat_template_kwargs or {}
    setup_trainer(trainer, agentic, tokenizer)
    return trainer


def prompt_lengths(dataset: Any, trainer: Any, name: str) -> tuple[int, ...]:
    """Token counts of every row's prompt, tokenized by the trainer's own `_tokenize_prompts` (never truncated);
    with environments, after each row's `reset` observation, in the row's environment's tool schemas."""
    from .agentic import batch_prompts

    if "prompt" not in dataset.column_names and trainer.environment_factories is None:
        raise DatasetError(f"the {name} dataset has no 'prompt' column (it has {', '.join(dataset.column_names)}); "
                           "GRPO, RLOO and Distillation generate from 'prompt': rename the column or pass another "
                           "dataset")
    lengths: list[int] = []
    for start in range(0, len(dataset), _TOKENIZE_CHUNK):
        prompts = batch_prompts(trainer, dataset[start:start + _TOKENIZE_CHUNK])
        try:
            ids, _, _ = trainer._tokenize_prompts(prompts)
        except Exception as exc:  # the tokenizer raises many types for unusable prompts
            raise DatasetError(f"cannot tokenize the {name} prompts: {first_line(exc)}") from exc
        lengths.extend(len(row) for row in ids)
    return tuple(lengths)


def train_order(args: TrainingArgs, trainer: Any, train: Any, *, repeat: generation_stream.Repeat, batch_size: int,
                option: str, warnings: list[str], lengths: tuple[int, ...] | None = None,
                ) -> tuple[tuple[int, ...], Callable[[int], RankBatches], TrainLoop]:
    """The train prompts' lengths, each epoch's per-rank batches and the Trainer's loop: TRL's `RepeatSampler` with
    `repeat`'s arguments (one permutation per epoch) over a map-style dataset, or its stream counterpart (a note
    saying what was read goes to `warnings`). `batch_size`: the train dataloader's, set by `option`; `lengths`:
    the prompts' lengths where the caller has them (a vision run's, with their image tokens)."""
    from trl.trainer.utils import RepeatSampler

    from .loop import sampled_epochs, train_loop

    config = args.training
    if generation_stream.is_stream(train):
        generation_stream.check_supported(args)
        streamed, loop, note = generation_stream.train_order(args, trainer, train, repeat=repeat,
                                                             batch_size=batch_size, option=option)
        warnings.append(note)
        return streamed.lengths, streamed.epoch_batches, loop
    lengths = prompt_lengths(train, trainer, "train") if lengths is None else lengths
    sampler = RepeatSampler(range(len(lengths)), mini_repeat_count=repeat.mini_repeat_count,
                            batch_size=repeat.batch_size, repeat_count=repeat.repeat_count,
                            shuffle=config.shuffle_dataset, seed=config.seed)
    epoch_batches = sampled_epochs(args, sampler, batch_size, option)
    loop = train_loop(args, epoch_batches)
    if loop.steps_in_epoch == 0:
        raise DatasetError(f"the train dataset has {len(lengths)} prompts, fewer than one generation batch holds "
                           f"({repeat.batch_size} unique prompts); add prompts or lower the batch")
    return lengths, epoch_batches, loop


@dataclass(frozen=True)
class EvalLoop:
    """The eval prompts' lengths, the per-rank order of one evaluation, and the steps after which it runs (all
    empty without an eval dataset)."""

    lengths: tuple[int, ...] = ()
    order: RankBatches = ()
    steps: tuple[int, ...] = ()


def eval_loop(args: TrainingArgs, data: RunData, trainer: Any, loop: TrainLoop, generations: int, *,
              lengths: tuple[int, ...] | None = None) -> EvalLoop:
    """The eval loop of the run: `_get_eval_sampler` is a fresh `RepeatSampler` per evaluation (for a stream, a fresh
    seeded shuffle), seeded alike, so every evaluation walks the same order; `generations` completions per prompt."""
    if data.eval is None:
        return EvalLoop()
    if generation_stream.is_stream(data.eval):
        streamed = generation_stream.eval_order(args, trainer, data.eval, generations)
        return EvalLoop(streamed.lengths, streamed.epoch_batches(0), tuple(eval_steps_of(args, loop)))
    from trl.trainer.utils import RepeatSampler

    config = args.training
    lengths = prompt_lengths(data.eval, trainer, "eval") if lengths is None else lengths
    order = list(RepeatSampler(range(len(lengths)), mini_repeat_count=generations, seed=config.seed))
    shards = sharding(args)
    shards.rank_batch_size(config.per_device_eval_batch_size, "per_device_eval_batch_size")
    batches = ordered_batches(order, batch_size=config.per_device_eval_batch_size, sharding=shards,
                              drop_last=config.dataloader_drop_last)
    return EvalLoop(lengths, batches, tuple(eval_steps_of(args, loop)))


def sliding_window(args: TrainingArgs) -> int | None:
    """The run's model's sliding window, where some of its layers attend through one (Mistral/Qwen-style
    `sliding_window` with sliding `layer_types`, Gemma): transformers' static cache gives those layers
    min(sliding_window, cache length) slots (`StaticSlidingWindowLayer`), the full layers the cache length. None for
    a model without sliding layers, or whose config is not readable here."""
    from transformers import AutoConfig
    from transformers.cache_utils import get_layer_types_and_kwargs

    model = args.model
    if not model.model_name_or_path:
        return None
    try:
        config = AutoConfig.from_pretrained(model.model_name_or_path, revision=model.model_revision,
                                            trust_remote_code=bool(args.training.trust_remote_code))
        _, layers = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except (OSError, ValueError, AttributeError):  # no readable config: the report leaves the sliding layers out
        return None
    windows = {kwargs["sliding_window"] for kwargs in layers if kwargs.get("sliding_window")}
    return min(windows) if windows else None


def plan_run(args: TrainingArgs, data: RunData, *, train_lengths: tuple[int, ...], layout: GenerationLayout,
             loop: TrainLoop, epoch_batches: Callable[[int], RankBatches], evals: EvalLoop, config: dict[str, Any],
             warnings: Sequence[str] = (), images: Rows | None = None, eval_images: Rows | None = None,
             rollouts: Rollouts | None = None) -> Plan:
    """`plan_generation` on what the adapter gathered; `config`: what the plan records of the run (and its tools);
    `images` / `eval_images`: the prompts' grids of a vision-language run; `rollouts`: what the run's rollout
    function does with each batch of prompts."""
    if args.agentic:
        from .agentic import check_tool_turns

        layout = dataclasses.replace(layout, pin_cache=pins_cache(args.agentic, layout))
        config = {**config, **args.agentic.recorded(),
                  "tool_turns": layout.tool_loop.turns if layout.tool_loop else 0}
        # every rank generates on its batch each round, and on each eval batch at each evaluation
        rounds = (-(-loop.total_steps * loop.gradient_accumulation_steps // layout.generate_every)
                  * args.num_processes + len(evals.steps) * sum(map(len, evals.order)))
        check_tool_turns(layout, [*train_lengths, *evals.lengths], rounds=rounds, max_steps=loop.max_steps,
                         rows=max(layout.batch_size * layout.steps_per_generation, layout.eval_batch_size))
    return plan_generation(
        method=args.method,
        prompt_lengths=train_lengths,
        layout=layout,
        loop=loop,
        epoch_batches=epoch_batches,
        eval_prompt_lengths=evals.lengths,
        eval_batches=evals.order,
        eval_steps=list(evals.steps),
        images=images,
        eval_images=eval_images,
        rollouts=rollouts,
        generation_kwargs=args.training.generation_kwargs or {},
        config={**config, "sliding_window": sliding_window(args)},
        versions=versions(),
        fingerprint=run_fingerprint(data),
        warnings=warnings,
    )
