"""Distillation: prompt lengths from TRL's own `DistillationTrainer._tokenize_prompts`, the order from TRL's own
`RepeatSampler` as the trainer builds it (one generation per prompt, each round repeated `gradient_accumulation_steps`
times), and the generation settings, into `plan_generation` with the distillation layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import DatasetError, UsageError
from ..plan.distillation import distillation_layout
from ..plan.grpo import plan_generation
from ..plan.model import Plan
from .common import load_run_data, recorded_config, run_fingerprint, versions
from .grpo import _generation_settings, _static_caches, prompt_lengths
from .loop import eval_steps_of, sampled_epochs, train_loop
from .sampling import RankBatches, ordered_batches
from .trl_args import TrainingArgs


def _check_supported(args: TrainingArgs) -> None:
    config = args.training
    if config.teacher_model_name_or_path is None:
        raise UsageError("a teacher model is required for distillation, as `trl distillation` requires; pass "
                         "--teacher_model_name_or_path")
    if config.use_vllm:
        raise UsageError("use_vllm=True is not planned: vLLM does not run on Neuron; drop --use_vllm to generate "
                         "with transformers")
    if getattr(args.script, "dataset_streaming", False):
        raise UsageError(f"--dataset_streaming is not planned yet for {args.method}: TRL replaces its RepeatSampler "
                         "with a buffered shuffle of the stream (repeat_iterable_dataset), which shapeplan does not "
                         "replay; drop --dataset_streaming")


def _bare_trainer(tokenizer: Any, config: Any) -> Any:
    """A trainer with only the attributes `_tokenize_prompts` reads, set as `__init__` sets them for a text model."""
    from trl import DistillationTrainer

    trainer = DistillationTrainer.__new__(DistillationTrainer)
    trainer.processing_class = tokenizer
    trainer._is_vlm = False
    trainer.tools = []
    trainer.chat_template = None
    trainer.chat_template_kwargs = config.chat_template_kwargs or {}
    return trainer


def _train_batches(args: TrainingArgs, num_rows: int) -> Callable[[int], RankBatches]:
    """epoch -> per-rank generation batches, from the trainer's `_get_train_sampler` (one permutation per epoch)."""
    from trl.trainer.utils import RepeatSampler

    config = args.training
    accumulation = config.gradient_accumulation_steps
    sampler = RepeatSampler(range(num_rows), mini_repeat_count=1,
                            batch_size=config.per_device_train_batch_size * args.num_processes * accumulation,
                            repeat_count=accumulation, shuffle=config.shuffle_dataset, seed=config.seed)
    return sampled_epochs(args, sampler, config.per_device_train_batch_size * accumulation)


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    _check_supported(args)
    config = args.training
    generation = _generation_settings(config)
    data = load_run_data(args, eval_source=eval_source)
    tokenizer = data.tokenizer
    trainer = _bare_trainer(tokenizer, config)
    train_lengths = prompt_lengths(data.train, trainer, "train")
    epoch_batches = _train_batches(args, len(train_lengths))
    loop = train_loop(args, epoch_batches)
    round_size = config.per_device_train_batch_size * args.num_processes * config.gradient_accumulation_steps
    if loop.steps_in_epoch == 0:
        raise DatasetError(f"the train dataset has {len(train_lengths)} prompts, fewer than one generation batch "
                           f"holds ({round_size}); add prompts or lower the batch")
    layout = distillation_layout(
        batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        pad_to_multiple_of=config.pad_to_multiple_of,
        max_new_tokens=generation.max_new_tokens,
        static_cache=generation.cache_implementation in _static_caches() and generation.use_cache is not False,
        max_cache_len=generation.max_cache_len,
        eval_batch_size=config.per_device_eval_batch_size,
    )

    eval_lengths: tuple[int, ...] = ()
    eval_order: RankBatches = []
    eval_at: list[int] = []
    if data.eval is not None:
        from trl.trainer.utils import RepeatSampler

        eval_lengths = prompt_lengths(data.eval, trainer, "eval")
        # `_get_eval_sampler`: a fresh sampler per evaluation, seeded alike, so every evaluation walks the same order.
        order = list(RepeatSampler(range(len(eval_lengths)), mini_repeat_count=1, seed=config.seed))
        eval_order = ordered_batches(order, batch_size=config.per_device_eval_batch_size,
                                     num_processes=args.num_processes, drop_last=config.dataloader_drop_last)
        eval_at = eval_steps_of(args, loop)

    recorded = recorded_config(args, argv)
    recorded.update(teacher_model_name_or_path=config.teacher_model_name_or_path, generation_batch_size=round_size,
                    max_new_tokens=generation.max_new_tokens, max_cache_len=generation.max_cache_len,
                    shuffle_dataset=config.shuffle_dataset)
    return plan_generation(
        method="distillation",
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
    )
