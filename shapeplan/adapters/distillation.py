"""Distillation: prompt lengths from TRL's own `DistillationTrainer._tokenize_prompts`, the order from TRL's own
`RepeatSampler` as the trainer builds it (one generation per prompt, each round repeated `gradient_accumulation_steps`
times), and the generation settings, into `plan_generation` with the distillation layout."""

from __future__ import annotations

import inspect

from ..errors import UsageError
from ..plan.distillation import distillation_layout
from ..plan.model import Plan
from . import generation_stream
from .agentic import check_supported as check_agentic
from .agentic import tool_loop
from .common import load_run_data, recorded_config
from .generation import (
    bare_trainer,
    eval_loop,
    generation_settings,
    plan_run,
    refuse_unplannable,
    static_cache,
    tool_loop_warnings,
    train_order,
)
from .grpo import refuse_tools_on_plain_prompts
from .loop import sharding
from .trl_args import TrainingArgs

# what sets the train dataloader's batch size
_ROUND_BATCH = "per_device_train_batch_size x gradient_accumulation_steps"


def _check_supported(args: TrainingArgs) -> None:
    if args.training.teacher_model_name_or_path is None:
        raise UsageError("a teacher model is required for distillation, as `trl distillation` requires; pass "
                         "--teacher_model_name_or_path")
    refuse_unplannable(args)
    check_agentic(args.agentic, takes=args.spec.agentic, method=args.method)
    if any(inspect.iscoroutinefunction(tool) for tool in args.agentic.tools):
        raise UsageError("DistillationTrainer refuses async tools; pass synchronous functions as --tools")


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    _check_supported(args)
    config = args.training
    generation = generation_settings(config)
    data = load_run_data(args, eval_source=eval_source)
    refuse_tools_on_plain_prompts(args, data)  # TRL's tool loop reads completions as chat messages
    trainer = bare_trainer(args.spec, data.tokenizer, config, args.agentic)
    accumulation = config.gradient_accumulation_steps
    round_size = config.per_device_train_batch_size * args.num_processes * accumulation
    warnings = tool_loop_warnings(args)
    repeat = generation_stream.Repeat(mini_repeat_count=1, batch_size=round_size, repeat_count=accumulation)
    train_lengths, epoch_batches, loop = train_order(
        args, trainer, data.train, repeat=repeat, batch_size=config.per_device_train_batch_size * accumulation,
        option=_ROUND_BATCH, warnings=warnings)
    layout = distillation_layout(
        # the micro-batch both models run on: a rank's slice of it under split_batches
        batch_size=sharding(args).rank_batch_size(config.per_device_train_batch_size, "per_device_train_batch_size"),
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        pad_to_multiple_of=config.pad_to_multiple_of,
        max_new_tokens=generation.max_new_tokens,
        static_cache=static_cache(generation),
        max_cache_len=generation.max_cache_len,
        eval_batch_size=config.per_device_eval_batch_size,
        tool_loop=tool_loop(trainer, config, padded=args.agentic.pads),
    )
    evals = eval_loop(args, data, trainer, loop, generations=1)
    recorded = recorded_config(args, argv)
    recorded.update(teacher_model_name_or_path=config.teacher_model_name_or_path, generation_batch_size=round_size,
                    max_new_tokens=generation.max_new_tokens, max_cache_len=generation.max_cache_len,
                    shuffle_dataset=config.shuffle_dataset)
    return plan_run(args, data, train_lengths=train_lengths, layout=layout, loop=loop, epoch_batches=epoch_batches,
                    evals=evals, config=recorded, warnings=warnings)
