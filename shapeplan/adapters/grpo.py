"""GRPO and RLOO: prompt lengths from TRL's own `_tokenize_prompts`, the order from TRL's own `RepeatSampler`,
and the generation settings as the trainer builds them, into `plan_generation` (shapeplan/adapters/generation.py
holds what Distillation shares)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..errors import UsageError
from ..plan.grpo import GenerationLayout
from ..plan.model import Plan
from ..plan.rows import Rows
from ..plan.vision import fixed_sizes_of
from ..plan.vision.family import ImageFamily, Setting
from ..plan.vision_rows import ImageRow, image_rows
from . import generation_stream, vision
from .agentic import AgenticArguments, tool_loop
from .agentic import check_supported as check_agentic
from .common import RunData, load_run_data, recorded_config, streamed
from .generation import (
    bare_trainer,
    eval_loop,
    generation_configs,
    generation_settings,
    plan_run,
    refuse_unplannable,
    static_cache,
    tool_loop_warnings,
    train_order,
)
from .rollout import RolloutProbe
from .trl_args import TrainingArgs, make_parser, parse_training_args

# Options that choose data, model and device, not training: DATASET, --model and --split, and `use_cpu`, which
# `shapeplan warm` sets for the device it warms on.
_RUN_OPTIONS = {"dataset_name", "model_name_or_path", "dataset_train_split", "use_cpu"}
# The Python objects the run hands the trainer (--tools, --environment_factory, --rollout_func) and what the run
# does with them (--pad_tool_turns, --pin_cache):
# what the run calls, not how it trains; given alone they keep the guide's example settings.
_OBJECT_OPTIONS = frozenset(f.name for f in fields(AgenticArguments))
# what sets the train dataloader's batch size
_GENERATION_BATCH = "per_device_train_batch_size x steps_per_generation"


def with_guide_example(args: TrainingArgs, argv: list[str]) -> tuple[TrainingArgs, list[str]]:
    """`args`, or the guide's example (`TrainerSpec.guide_options`) when no TRL training option (and no --config)
    is given; plus a note. The run's objects (tools, an environment factory, a rollout function) are no training
    option: with them alone the guide's settings stay, the objects added."""
    spec = args.spec
    example = spec.guide_options
    if not example or "--config" in argv:
        return args, []
    trl_options = {action.dest for action in make_parser(spec)._actions}
    if (args.given & trl_options) - _RUN_OPTIONS - _OBJECT_OPTIONS:
        return args, []
    example_args = parse_training_args(spec, [*example, *argv])
    example_args.script.reward_funcs = list(spec.guide_reward_funcs)
    functions = len(spec.guide_reward_funcs)
    objects = sorted(args.given & _OBJECT_OPTIONS)
    with_objects = f", with the run's {' and '.join('--' + name for name in objects)}" if objects else ""
    note = (f"no training option given: planned TRL's Trainium guide {args.method.upper()} example "
            f"({' '.join(example)}, {'one' if functions == 1 else functions} reward function"
            f"{'' if functions == 1 else 's'}{with_objects}), not TRL's defaults; pass TRL options to plan your own "
            "run")
    return example_args, [note]


def refuse_tools_on_plain_prompts(args: TrainingArgs, data: RunData) -> None:
    """Refuse a tool loop (tools, or an environment's) over plain-string prompts: TRL decodes completions as chat
    messages only for conversational prompts, and its tool loop reads each completion as messages
    (`completion[0].get("tool_calls")`), so the run fails at its first step ('str' object has no attribute 'get')."""
    if not args.agentic.tool_loop:
        return
    from trl.data_utils import is_conversational

    given = "--tools" if args.agentic.tools else "--environment_factory"
    for name, dataset in (("train", data.train), ("eval", data.eval)):
        row = None if dataset is None else next(iter(dataset), None)
        if row is None or "prompt" not in row or is_conversational({"prompt": row["prompt"]}):
            continue
        raise UsageError(f"{given} needs conversational prompts, and the {name} dataset's are plain strings: TRL's "
                         "tool loop reads each completion as chat messages, so the run would fail at its first step "
                         "('str' object has no attribute 'get'); give each prompt as a list of messages, "
                         '[{"role": "user", "content": "..."}]')


def _check_supported(args: TrainingArgs) -> list[str]:
    """Refuse what planning cannot follow; warnings for what it plans without some of the run's shapes."""
    refuse_unplannable(args)
    check_agentic(args.agentic, takes=args.spec.agentic, method=args.method)
    if args.agentic.rollout_func is not None and streamed(args):
        raise UsageError("--rollout_func is planned from map-style datasets (it is run on each batch of prompts); "
                         "drop --dataset_streaming")
    config = args.training
    if config.use_transformers_continuous_batching:
        raise UsageError("use_transformers_continuous_batching=True is not planned (its batches follow memory, "
                         "not the config); drop it and pass --cache_implementation static")
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
    return warnings + tool_loop_warnings(args)


def _check_split(args: TrainingArgs) -> None:
    """Under split_batches the ranks together hold one dataloader batch (per_device_train_batch_size x
    steps_per_generation prompts, per_device_eval_batch_size in eval), and the trainer groups the gathered rewards of
    each prompt's generations (`view(-1, num_generations)`), which fails on a batch holding a partial group."""
    config = args.training
    if not (args.num_processes > 1 and config.accelerator_config.split_batches):
        return
    sizes = [(_GENERATION_BATCH, config.per_device_train_batch_size * config.steps_per_generation,
              config.num_generations),
             ("per_device_eval_batch_size", config.per_device_eval_batch_size,
              config.num_generations_eval or config.num_generations)]
    for option, size, generations in sizes:
        if size % generations:
            raise UsageError(f"with split_batches all ranks together hold {option}={size} completions, which the "
                             f"trainer groups by {generations} generations and fails on; set {option} to a multiple "
                             "of the generations or drop split_batches")


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    return read(args, argv, eval_source=eval_source).plan()


@dataclass(frozen=True)
class GenerationRun:
    """A GRPO / RLOO run read once: its data, the planning trainer and, for a vision-language run, its prompts'
    rendered tokens and image sizes; what each plan of it derives from (the run as given, and `advise`'s image
    what-ifs)."""

    args: TrainingArgs
    argv: list[str]
    data: RunData
    trainer: Any
    warnings: tuple[str, ...]
    prompts: VisionPrompts | None

    @property
    def processing(self) -> ImageFamily:
        if self.prompts is None:
            raise ValueError("a text run has no image processing")
        return self.prompts.processor.family

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """Every train image's (height, width), as the processor receives it."""
        return [size for row in self.prompts.train for size in row.sizes] if self.prompts else []

    def plan(self, setting: Setting | None = None) -> Plan:
        """The run's plan; `setting`: a what-if of its images' family (`ImageFamily.settings`)."""
        args, config, trainer, data = self.args, self.args.training, self.trainer, self.data
        images = self.prompts.rows(setting) if self.prompts else None
        warnings = list(self.warnings)
        generation = generation_settings(config)
        # Parsed with the run's process count (see trl_args), so these are the run's.
        steps, size = config.steps_per_generation, config.generation_batch_size
        repeat = generation_stream.Repeat(mini_repeat_count=config.num_generations,
                                          batch_size=size // config.num_generations,
                                          repeat_count=config.num_iterations * steps)
        train_lengths, epoch_batches, loop = train_order(
            args, trainer, data.train, repeat=repeat, batch_size=config.per_device_train_batch_size * steps,
            option=_GENERATION_BATCH, warnings=warnings, lengths=images[0].lengths if images else None)

        # GRPO needs old log-probs only when generation and optimizer steps are misaligned; RLOO always computes them.
        old_logprob = (args.spec.old_logprobs_always
                       or config.gradient_accumulation_steps % (steps * config.num_iterations) != 0)
        ref = config.beta != 0.0
        round_forwards = ("old_logprob",) * old_logprob + ("ref",) * ref
        eval_forwards = ("eval",) + ("eval",) * old_logprob + ("ref",) * ref
        layout = GenerationLayout(
            batch_size=config.per_device_train_batch_size,
            steps_per_generation=steps,
            num_iterations=config.num_iterations,
            pad_to_multiple_of=config.pad_to_multiple_of,
            max_new_tokens=generation.max_new_tokens,
            static_cache=static_cache(generation),
            max_cache_len=generation.max_cache_len,
            round_forwards=round_forwards,
            eval_batch_size=config.per_device_eval_batch_size,
            eval_forwards=eval_forwards,
            tool_loop=tool_loop(trainer, config, padded=args.agentic.pads),
        )
        evals = eval_loop(args, data, trainer, loop, config.num_generations_eval or config.num_generations,
                          lengths=images[1].lengths if images and images[1] else None)
        recorded = recorded_config(args, self.argv)
        recorded.update(max_new_tokens=generation.max_new_tokens, max_cache_len=generation.max_cache_len,
                        num_generations_eval=config.num_generations_eval, shuffle_dataset=config.shuffle_dataset,
                        **(vision.vision_config(self.prompts.processor, setting) if self.prompts else {}))
        return plan_run(args, data, train_lengths=train_lengths, layout=layout, loop=loop,
                        epoch_batches=epoch_batches, evals=evals, config=recorded, warnings=warnings,
                        images=images[0] if images else None, eval_images=images[1] if images else None,
                        rollouts=self._rollouts(generation.max_new_tokens))

    def _rollouts(self, max_new_tokens: int) -> RolloutProbe | None:
        """The run's rollout function, run on the batches of prompts the plan asks about; None without one."""
        func, data = self.args.agentic.rollout_func, self.data
        if func is None:
            return None
        prompts = {"train": data.train["prompt"], "eval": data.eval["prompt"] if data.eval is not None else []}
        model_config, model_generation = generation_configs(self.args, data.tokenizer)
        return RolloutProbe(func, self.trainer, prompts, config=self.args.training, max_new_tokens=max_new_tokens,
                            model_config=model_config, model_generation=model_generation)


@dataclass(frozen=True)
class VisionPrompts:
    """A vision-language run's prompts: rendered tokens (one placeholder per image) and image sizes."""

    processor: vision.VisionProcessor
    train: tuple[ImageRow, ...]
    eval: tuple[ImageRow, ...] | None

    def rows(self, setting: Setting | None) -> tuple[Rows, Rows | None]:
        """The prompts' lengths with their image tokens, and their images' keys (under a what-if's setting: its
        sizes, its family; GRPO is refused for a family whose expansions merge with their text, so the rows
        stand)."""
        resize = fixed_sizes_of(setting)
        processor = self.processor if setting is None else self.processor.with_family(setting.family)
        evaluated = None if self.eval is None else image_rows(self.eval, processor.family, processor.tokens, None,
                                                              resize)
        return image_rows(self.train, processor.family, processor.tokens, None, resize), evaluated


def read(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None) -> GenerationRun:
    """The run read once (`plan` and `advise` derive its plans from it)."""
    args, notes = with_guide_example(args, argv)
    warnings = notes + _check_supported(args)
    _check_split(args)
    data = load_run_data(args, eval_source=eval_source, vision=args.spec.images)
    refuse_tools_on_plain_prompts(args, data)
    trainer = bare_trainer(args.spec, data.tokenizer, args.training, args.agentic)
    return GenerationRun(args=args, argv=argv, data=data, trainer=trainer, warnings=tuple(warnings),
                         prompts=_vision_prompts(args, data, trainer))


# The trainer shuffles a vision round's rows before cutting its micro-batches, so each can hold any of the round's
# rows (plan/grpo.py, `_slices`): beyond this many choices of how many rows of each prompt a micro-batch holds, a
# round is refused rather than planned.
MAX_SLICES = 10_000


def _check_slices(args: TrainingArgs) -> None:
    """Refuse a vision run whose rounds' micro-batches can hold more choices of prompts than MAX_SLICES."""
    config = args.training
    rows, size = config.per_device_train_batch_size * config.steps_per_generation, config.per_device_train_batch_size
    # a rank's round holds its rows' prompts, num_generations rows each (one more, partly, where ranks split them)
    prompts = -(-rows // config.num_generations) + (args.num_processes > 1)
    ways = [1] + [0] * size  # ways[n]: the choices of how many rows of each prompt make n rows
    for _ in range(prompts):
        ways = [sum(ways[n - k] for k in range(min(n, config.num_generations) + 1)) for n in range(size + 1)]
    if config.steps_per_generation > 1 and ways[size] > MAX_SLICES:
        raise UsageError(f"steps_per_generation={config.steps_per_generation} on a vision-language {args.method} run: "
                         "the trainer shuffles each round's rows before cutting its micro-batches, so each can hold "
                         f"any {size} of its {rows} rows, {ways[size]:,} choices of prompts to plan a round (more "
                         f"than {MAX_SLICES:,}); lower per_device_train_batch_size or steps_per_generation "
                         "(gradient_accumulation_steps)")


def _vision_prompts(args: TrainingArgs, data: RunData, trainer: Any) -> VisionPrompts | None:
    """A vision-language GRPO or RLOO run's train and eval prompts, after what shapeplan does not plan on images is
    refused; None for a text run."""
    if not vision.is_vision(data.train):
        if data.eval is not None and vision.is_vision(data.eval):
            raise UsageError("the eval dataset has images and the train dataset has none; plan them apart")
        return None
    if streamed(args):
        raise UsageError(f"vision-language {args.method} runs are planned from map-style datasets; drop "
                         "--dataset_streaming")
    if args.agentic:
        raise UsageError(f"tools and environments on vision-language {args.method} runs are not planned yet (tool "
                         "images take another path); drop --tools / --environment_factory")
    _check_slices(args)
    processor = vision.run_processor(args, data.tokenizer)
    refusal = processor.family.generation_refusal()
    if refusal is not None:
        raise UsageError(f"{args.method} with a {processor.model_type} model's images is not planned: {refusal}; "
                         "SFT runs of it are")
    train = vision.prompt_rows(data.train, processor, trainer, name="train")
    evaluated = None if data.eval is None else vision.prompt_rows(data.eval, processor, trainer, name="eval")
    return VisionPrompts(processor=processor, train=train, eval=evaluated)
