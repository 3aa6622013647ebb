"""SFT: prepared row lengths from TRL's own `SFTTrainer._prepare_dataset`, and the batch order, into `plan_sft`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..errors import DatasetError, ModelError, UsageError
from ..plan.batches import RunInfo
from ..plan.model import Plan
from ..plan.rows import Rows
from ..plan.sft import SFTLayout, plan_sft
from ..plan.vision import fixed_sizes_of
from ..plan.vision.family import ImageFamily, Setting
from ..plan.vision_rows import ImageRow
from . import length_cache, lengths, stream, vision
from .common import (
    RunData,
    apply_chat_template_path,
    load_run_data,
    recorded_config,
    run_fingerprint,
    streamed,
    trl_preparing,
    versions,
)
from .loop import check_strategy, eval_schedule, eval_steps_of, sharding, train_schedule
from .trl_args import TrainingArgs


def _row_format(example: dict[str, Any], text_field: str) -> str:
    from .lengths import is_conversational

    if "input_ids" in example:
        return "tokenized"
    if is_conversational(example):
        return "conversational"
    absent = [c for c in ("messages", "conversations", "prompt", "completion") if c in example and example[c] is None]
    if absent:  # a row without a column the file's other rows have
        raise _mixed_formats("row 0", absent[0], example)
    for column in ("messages", "conversations", "prompt"):
        if column in example and not isinstance(example[column], str):
            raise DatasetError(f"column {column!r} holds neither text nor a list of {{'role', 'content'}} messages; "
                               "fix the dataset's rows")
    if "prompt" in example and "completion" in example:
        if isinstance(example["prompt"], str) != isinstance(example["completion"], str):
            raise DatasetError("a row's prompt and completion differ in format (one text, the other a list of "
                               "messages); give every row one format (messages, text, or prompt and completion)")
        return "prompt-completion"
    if isinstance(example.get(text_field), str):
        return "text"
    raise DatasetError(f"dataset has no usable column (it has {', '.join(example) or 'none'}); SFT needs "
                       f"'messages' (a list of role/content messages), a text column '{text_field}' (set "
                       "--dataset_text_field) or 'prompt' and 'completion'")


def _mixed_formats(row: str, column: str, example: dict[str, Any]) -> DatasetError:
    present = ", ".join(name for name, value in example.items() if value is not None)
    return DatasetError(f"the dataset mixes row formats: {row} has no {column!r} (it has {present}); give every row "
                        "one format (messages, text, or prompt and completion)")


def _check_one_format(dataset: Any, first: dict[str, Any], fmt: str, text_field: str) -> None:
    """Every row has the columns of the first row's format: a file of rows of two formats loads as one table, each
    row None in the other format's columns, on which TRL's preparation fails with "'NoneType' object is not
    iterable". Read from the Arrow columns' null counts, without decoding a row."""
    import datasets

    if not isinstance(dataset, datasets.Dataset) or fmt == "tokenized":
        return
    used = [text_field] if fmt == "text" else \
        [c for c in ("messages", "conversations", "prompt", "completion") if first.get(c) is not None]
    for column in used:
        values = dataset.with_format("arrow")[column]
        if values.null_count:
            import pyarrow.compute as pc

            index = pc.index(values.is_null(), True).as_py()
            raise _mixed_formats(f"row {index}", column, dataset[index])


class _BareTrainer:
    """What `SFTTrainer._prepare_dataset` reads of its trainer, set as `SFTTrainer.__init__` sets it; the trainer
    itself (TRL's trainer module: seconds of imports) is built when TRL's preparation runs."""

    def __init__(self, tokenizer: Any, chat_template: str | None, completion_only_loss: bool) -> None:
        self._tokenizer, self.chat_template, self.completion_only_loss = tokenizer, chat_template, completion_only_loss

    def _prepare_dataset(self, *args: Any, **kwargs: Any) -> Any:
        from trl import SFTTrainer

        trainer = SFTTrainer.__new__(SFTTrainer)
        trainer._tokenizer, trainer.chat_template = self._tokenizer, self.chat_template
        trainer.completion_only_loss = self.completion_only_loss
        return trainer._prepare_dataset(*args, **kwargs)


def _bare_trainer(tokenizer: Any, config: Any, first_example: dict[str, Any]) -> Any:
    """An `SFTTrainer` with only the attributes `_prepare_dataset` reads, set as `SFTTrainer.__init__` sets them."""
    from .lengths import is_conversational

    if config.eos_token is not None:
        if config.eos_token not in tokenizer.get_vocab():
            raise UsageError(f"eos_token {config.eos_token!r} is not in the tokenizer's vocabulary; "
                             "pass a token the tokenizer has with --eos_token")
        tokenizer.eos_token = config.eos_token
    if config.assistant_only_loss and not is_conversational(first_example):
        raise UsageError("assistant_only_loss=True needs a conversational dataset ('messages'); "
                         "drop --assistant_only_loss or use conversational data")
    chat_template = None
    if config.assistant_only_loss:
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers

        if not has_generation_markers(tokenizer.chat_template):
            chat_template = get_training_chat_template(tokenizer)
    if config.completion_only_loss is None:
        completion_only_loss = "prompt" in first_example and "completion" in first_example
    else:
        completion_only_loss = config.completion_only_loss
    return _BareTrainer(tokenizer, chat_template, completion_only_loss)


def prepare_rows(dataset: Any, tokenizer: Any, config: Any, *, packing: bool, name: str,
                 use_cache: bool = True) -> tuple[Rows, int]:
    """The rows `SFTTrainer` trains on, as lengths; and how many input rows preparation dropped."""
    trainer = _preparer(dataset, tokenizer, config, packing=packing)  # sets the EOS token: before the key
    # --- lengths cache and fast path (shapeplan.adapters.length_cache, shapeplan.adapters.lengths) ---
    key = length_cache.length_key(dataset, tokenizer, config, packing=packing) if use_cache else None
    cached = length_cache.load(key) if key is not None else None
    if cached is not None:
        rows, dropped = cached
    else:
        rows, dropped = _prepared_rows(dataset, tokenizer, config, trainer, packing=packing, name=name)
        if key is not None:
            length_cache.store(key, rows, dropped)
    # ---
    if not rows.lengths:
        raise DatasetError(f"every row of the {name} dataset was dropped: no row keeps a trainable token within "
                           f"max_length={config.max_length}; raise --max_length or check the loss masks")
    return rows, dropped


def _preparer(dataset: Any, tokenizer: Any, config: Any, *, packing: bool) -> Any:
    """The bare `SFTTrainer` whose `_prepare_dataset` prepares `dataset`, after the checks TRL's preparation would
    fail on; None with skip_prepare_dataset."""
    first = next(iter(dataset))
    fmt = _row_format(first, config.dataset_text_field)
    _check_one_format(dataset, first, fmt, config.dataset_text_field)
    if fmt == "conversational" and tokenizer.chat_template is None:
        raise ModelError("the dataset is conversational but the tokenizer has no chat template; pass "
                         "--chat_template_path FILE.jinja or a model whose tokenizer has one")
    if packing and config.max_length is None:
        raise UsageError("packing needs max_length; pass --max_length N")
    skip = (config.dataset_kwargs or {}).get("skip_prepare_dataset", False)
    return None if skip else _bare_trainer(tokenizer, config, first)


def _prepared_rows(dataset: Any, tokenizer: Any, config: Any, trainer: Any, *, packing: bool,
                   name: str) -> tuple[Rows, int]:
    if trainer is None:  # skip_prepare_dataset
        prepared = dataset
    else:
        with trl_preparing(name):
            if lengths.fast_path_refusal(dataset, tokenizer, config) is None:
                return lengths.fast_prepared_rows(trainer, dataset, tokenizer, config, packing=packing, name=name)
            prepared = trainer._prepare_dataset(dataset, tokenizer, config, packing, None, name)
    if "input_ids" not in prepared.column_names:
        raise DatasetError(f"the {name} dataset has no 'input_ids' column after preparation; with "
                           "skip_prepare_dataset the dataset must be tokenized already")
    dropped = 0 if packing else len(dataset) - len(prepared)
    return lengths.dataset_rows(prepared), dropped


def plan(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None, use_cache: bool = True) -> Plan:
    config = args.training
    streaming = streamed(args)
    accelerator = config.accelerator_config
    if streaming:
        stream.check_run(args)
    else:  # a stream has no sampler: the Trainer ignores train_sampling_strategy
        check_strategy(args, length_aware=True)
    # SFTTrainer checks this once, against the train packing, for train and eval alike.
    if config.padding_free and not config.packing and config.max_length is not None:
        raise UsageError("padding_free=True without packing does not enforce max_length; enable --packing or pass "
                         "--max_length none")
    data = load_run_data(args, eval_source=eval_source, vision=True)
    tokenizer = data.tokenizer
    apply_chat_template_path(tokenizer, config.chat_template_path)
    padding_free = bool(config.padding_free or (config.packing and config.packing_strategy in {"bfd", "bfd_split"}))
    layout = SFTLayout(pad_to_multiple_of=config.pad_to_multiple_of, padding_free=padding_free)
    warnings = _run_warnings(config)
    if vision.is_vision(data.train):
        if streaming:
            return _plan_vision_stream(args, argv, data, warnings)
        return plan_vision(_read_vision(args, argv, data, warnings))
    if data.eval is not None and vision.is_vision(data.eval):
        raise UsageError("the eval dataset has images and the train dataset has none: SFTTrainer picks its collator "
                         "from the train rows, so the eval images are not fed to the model; drop the eval set's "
                         "image columns or train on images too")
    if streaming:
        return _plan_stream(args, argv, data, layout, warnings)

    _check_dispatch(args, padding_free)
    if sharding(args).dispatch_batches and config.train_sampling_strategy == "batch_rebalance":
        warnings.append("dispatch_batches with train_sampling_strategy='batch_rebalance': only rank 0's dataloader "
                        "is read, and its sampler holds rank 0's share of each epoch, so the run trains on 1/"
                        f"{args.num_processes} of the data; drop dispatch_batches to train on all of it")
    train_rows, dropped = prepare_rows(data.train, tokenizer, config, packing=config.packing, name="train",
                                       use_cache=use_cache)
    strategy = config.train_sampling_strategy
    # Without the seedable sampler, accelerate keeps torch's RandomSampler, which seeds itself from the global RNG.
    exact = strategy in ("sequential", "batch_rebalance") or (
        strategy == "random" and accelerator.use_seedable_sampler)
    if not exact:
        cause = f"train_sampling_strategy={strategy!r}" if strategy != "random" else "use_seedable_sampler=False"
        warnings.insert(0, f"{cause} draws the train order from the global RNG: train shapes are every shape some "
                        "order can produce, with the most micro-batches and the earliest step each can have")
    epoch_batches, loop = train_schedule(args, len(train_rows), train_rows.lengths)
    info = RunInfo(
        method=args.method, rows=len(train_rows), pad_to_multiple_of=config.pad_to_multiple_of, dropped_rows=dropped,
        exact=exact, config=recorded_config(args, argv), versions=versions(),
        fingerprint=run_fingerprint(data),
        warnings=warnings,
    )
    if data.eval is None:
        return plan_sft(train_rows=train_rows, layout=layout, loop=loop, epoch_batches=epoch_batches, info=info)
    eval_packing = config.packing if config.eval_packing is None else config.eval_packing
    eval_rows, _ = prepare_rows(data.eval, tokenizer, config, packing=eval_packing, name="eval", use_cache=use_cache)
    eval_order, eval_at = eval_schedule(args, loop, len(eval_rows), eval_rows.lengths)
    return plan_sft(train_rows=train_rows, layout=layout, loop=loop, epoch_batches=epoch_batches, info=info,
                    eval_rows=eval_rows, eval_batches=eval_order, eval_steps=eval_at)


@dataclass(frozen=True)
class VisionRun:
    """A vision-language run with its rows read once (every image's size, every row's rendered tokens): what each
    of its plans derives from, the run as given and each fixed-size what-if (`shapeplan advise`)."""

    args: TrainingArgs
    argv: list[str]
    data: RunData
    processor: vision.VisionProcessor
    train: tuple[ImageRow, ...]
    eval: tuple[ImageRow, ...] | None
    warnings: tuple[str, ...]

    @property
    def processing(self) -> ImageFamily:
        return self.processor.family

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """Every train image's (height, width), as the processor receives it."""
        return [size for row in self.train for size in row.sizes]

    def plan(self, setting: Setting | None = None) -> Plan:
        return plan_vision(self, setting)


def vision_run(args: TrainingArgs, argv: list[str], *, eval_source: str | None = None) -> VisionRun | None:
    """The run's rows read, when its train set has images; None for a text run."""
    data = load_run_data(args, eval_source=eval_source, vision=True)
    apply_chat_template_path(data.tokenizer, args.training.chat_template_path)
    if not vision.is_vision(data.train):
        return None
    return _read_vision(args, argv, data, _run_warnings(args.training))


def _vision_processor(args: TrainingArgs, data: RunData) -> vision.VisionProcessor:
    """The run's processor, after what SFTTrainer refuses on image data has been checked."""
    _check_vision(args, data)
    return vision.run_processor(args, data.tokenizer)


def _read_vision(args: TrainingArgs, argv: list[str], data: RunData, warnings: list[str]) -> VisionRun:
    config = args.training
    if streamed(args):
        raise UsageError("advise reads a vision dataset whole to weigh its images, which a stream is not; drop "
                         "--dataset_streaming to advise on the same rows (`analyze` plans the streamed run)")
    processor = _vision_processor(args, data)
    with trl_preparing("train"):
        train = vision.read_rows(data.train, processor, config, name="train")
    evaluated = None
    if data.eval is not None:
        with trl_preparing("eval"):
            evaluated = vision.read_rows(data.eval, processor, config, name="eval")
    return VisionRun(args=args, argv=argv, data=data, processor=processor, train=train, eval=evaluated,
                     warnings=tuple(warnings))


def _under(run: VisionRun, family: ImageFamily) -> VisionRun:
    """The run with its processor's family under other settings (a what-if); its rows read again where the family's
    expansions merge with their text (the merges follow the expansions)."""
    processor = run.processor.with_family(family)
    if not family.MERGES_WITH_TEXT:
        return replace(run, processor=processor)
    config = run.args.training
    return replace(run, processor=processor, train=vision.read_rows(run.data.train, processor, config, name="train"),
                   eval=None if run.data.eval is None else vision.read_rows(run.data.eval, processor, config,
                                                                            name="eval"))


def plan_vision(run: VisionRun, setting: Setting | None = None) -> Plan:
    """A vision-language run's plan: `DataCollatorForVisionLanguageModeling` processes each batch (TRL does not
    prepare the dataset), padding (B, R(min(longest row, max_length))) and concatenating the batch's image patches.
    `setting`: a what-if of the family's (`ImageFamily.settings`): its images resized to the setting's sizes, the
    processor's family under the setting."""
    resize = fixed_sizes_of(setting)
    if setting is not None and setting.family != run.processor.family:
        run = _under(run, setting.family)
    args, config = run.args, run.args.training
    layout = SFTLayout(pad_to_multiple_of=config.pad_to_multiple_of, padding_free=False)
    train_rows = vision.collated_rows(run.train, run.processor, config, name="train", resize=resize)
    epoch_batches, loop = train_schedule(args, len(train_rows))
    recorded = {**recorded_config(args, run.argv), **vision.vision_config(run.processor, setting)}
    info = RunInfo(method=args.method, rows=len(train_rows), pad_to_multiple_of=config.pad_to_multiple_of,
                   exact=True, config=recorded, versions=versions(), fingerprint=run_fingerprint(run.data),
                   warnings=run.warnings)
    if run.eval is None:
        return plan_sft(train_rows=train_rows, layout=layout, loop=loop, epoch_batches=epoch_batches, info=info)
    eval_rows = vision.collated_rows(run.eval, run.processor, config, name="eval", resize=resize)
    eval_order, eval_at = eval_schedule(args, loop, len(eval_rows), None)
    return plan_sft(train_rows=train_rows, layout=layout, loop=loop, epoch_batches=epoch_batches, info=info,
                    eval_rows=eval_rows, eval_batches=eval_order, eval_steps=eval_at)


def _plan_vision_stream(args: TrainingArgs, argv: list[str], data: RunData, warnings: list[str]) -> Plan:
    """A streamed vision-language run: SFTTrainer does not prepare (nor shuffle) a vision dataset, so each rank's
    batches are its stream's raw rows in stream order (see `shapeplan.adapters.stream`), each row read as for a
    map-style dataset; the eval stream read whole at each evaluation."""
    config = args.training
    processor = _vision_processor(args, data)

    def reader(name: str) -> stream.Read[ImageRow]:
        def read(part: Any, limit: int | None, counting: stream.Reader, epoch: int) -> Iterator[ImageRow]:
            rows = counting.rows(vision.undecoded(stream.in_pass(part, epoch)))
            with trl_preparing(name):
                yield from vision.iter_rows(rows, processor, config, name=name)
        return read

    def check(name: str) -> Callable[[int], None]:
        def not_empty(rows: int) -> None:
            if not rows:
                raise DatasetError(f"the {name} stream yields no rows; check the data files")
        return not_empty

    train, loop, note = stream.read_train(data.train, args, reader("train"), check("train"))
    train_rows = vision.collated_rows(tuple(train.rows), processor, config, name="train")
    info = RunInfo(method=args.method, rows=train.rows_per_pass, pad_to_multiple_of=config.pad_to_multiple_of,
                   exact=True, config=recorded_config(args, argv), versions=versions(),
                   fingerprint=run_fingerprint(data), warnings=[*warnings, note])
    layout = SFTLayout(pad_to_multiple_of=config.pad_to_multiple_of, padding_free=False)
    if data.eval is None:
        return plan_sft(train_rows=train_rows, layout=layout, loop=loop, epoch_batches=train.epoch_batches,
                        info=info)
    evaluated = stream.read_eval(data.eval, args, reader("eval"), check("eval"))
    return plan_sft(train_rows=train_rows, layout=layout, loop=loop, epoch_batches=train.epoch_batches, info=info,
                    eval_rows=vision.collated_rows(tuple(evaluated.rows), processor, config, name="eval"),
                    eval_batches=evaluated.batches, eval_steps=eval_steps_of(args, loop))


def _check_vision(args: TrainingArgs, data: RunData) -> None:
    """What `SFTTrainer` and its vision collator refuse on image data, and what shapeplan does not plan yet, each
    before any image is read."""
    config = args.training
    if config.packing:
        raise UsageError("TRL refuses packing on vision datasets; drop --packing")
    if config.padding_free:
        raise UsageError("TRL refuses padding_free on vision datasets; drop --padding_free")
    if config.max_length is not None and config.truncation_mode == "keep_end":
        raise UsageError("TRL refuses truncation_mode='keep_end' on vision datasets (it would cut image tokens); use "
                         "keep_start or --max_length none")
    multiple = config.pad_to_multiple_of
    if config.max_length is not None and multiple and config.max_length % multiple:
        # the vision collator pads and truncates in the tokenizer, which refuses the pair (ValueError)
        raise UsageError(f"transformers refuses max_length={config.max_length} with pad_to_multiple_of={multiple} on "
                         "vision datasets (the processor truncates and pads in one call, and the length must be a "
                         f"multiple); pass --max_length {config.max_length // multiple * multiple or multiple}")
    first = next(iter(data.train))
    if config.assistant_only_loss and "messages" not in first:
        raise UsageError("TRL's vision collator takes assistant_only_loss only with 'messages' rows (ValueError); "
                         "drop --assistant_only_loss, or give the rows as 'messages'")
    prompt_completion = "prompt" in first and "completion" in first
    if prompt_completion and config.pad_to_multiple_of is not None:
        raise UsageError("TRL's vision collator does not pad prompt-completion rows to a multiple "
                         f"(NotImplementedError, and pad_to_multiple_of='auto' is {config.pad_to_multiple_of} on "
                         "Neuron); pass --pad_to_multiple_of none, or use 'messages' rows, which it pads")
    if "messages" not in first and not prompt_completion and config.remove_unused_columns:
        # SFTTrainer keeps messages, prompt, completion, image and images of a vision dataset: the text goes
        raise UsageError(f"TRL drops the {config.dataset_text_field!r} column of a vision dataset "
                         "(remove_unused_columns), and its collator then fails on the first batch; pass "
                         "--remove_unused_columns false, or use 'messages' rows")
    if streamed(args):
        return  # a stream has no sampler, and SFTTrainer forces dispatch_batches off for it
    strategy = config.train_sampling_strategy
    if strategy not in ("random", "sequential"):
        if config.length_column_name not in first:
            # transformers' length-aware samplers read each row's first model input (the processor's: pixel_values),
            # which TRL never adds to the unprepared rows of a vision dataset
            raise UsageError(f"train_sampling_strategy={strategy!r} fails on a vision dataset without a "
                             f"{config.length_column_name!r} column (transformers reads each row's first model "
                             "input, which vision rows do not hold: ValueError); use random or sequential")
        raise UsageError(f"train_sampling_strategy={strategy!r} on vision datasets is not planned yet; use random "
                         "or sequential")
    if strategy == "random" and not config.accelerator_config.use_seedable_sampler:
        raise UsageError("use_seedable_sampler=False on vision datasets is not planned yet (the order, and so each "
                         "batch's images, comes from the global RNG); keep the seedable sampler")
    if bool(config.accelerator_config.dispatch_batches) and args.num_processes > 1:
        raise UsageError("dispatch_batches on vision datasets is not planned yet (rank 0 would concatenate the "
                         "ranks' pixel batches); drop dispatch_batches")


def _run_warnings(config: Any) -> list[str]:
    warnings = []
    if config.resume_from_checkpoint:
        warnings.append("resume_from_checkpoint: this plans the run from step 1; the resumed run skips the steps "
                        "before its checkpoint and meets only the shapes after it")
    if config.label_smoothing_factor > 0:
        warnings.append("label_smoothing_factor > 0 runs two forwards on every train batch (full logits with "
                        "grad, then the fused head without), so each train shape compiles two graphs")
    return warnings


def _check_dispatch(args: TrainingArgs, padding_free: bool) -> None:
    """A padding-free batch is one row of every sequence, (1, tokens), which dispatch_batches cannot slice by rows."""
    if bool(args.training.accelerator_config.dispatch_batches) and args.num_processes > 1 and padding_free:
        raise UsageError("dispatch_batches=true slices each collated batch by rows across the ranks, and a "
                         "padding-free batch (padding_free, or bfd packing) is one row (1, tokens), which accelerate "
                         "slices into empty batches or fails to concatenate; drop dispatch_batches or padding-free "
                         "batches")


def _plan_stream(args: TrainingArgs, argv: list[str], data: RunData, layout: SFTLayout,
                 warnings: list[str]) -> Plan:
    """A streaming run: max_steps x GA micro-batches per rank over the stream's first prepared rows, in stream order
    (see `shapeplan.adapters.stream`), or passes over a stream shorter than that; the eval stream read whole at each
    evaluation."""
    config = args.training
    train, loop, read = stream.read_train(data.train, args, _stream_reader(data.train, data.tokenizer, config,
                                                                            packing=config.packing, name="train"),
                                          _stream_check(config, "train"), shuffled=config.shuffle_dataset)
    warnings.append(read)
    train_rows = stream.sft_rows(train.rows)
    info = RunInfo(method=args.method, rows=train.rows_per_pass, pad_to_multiple_of=config.pad_to_multiple_of,
                   exact=True, config=recorded_config(args, argv), versions=versions(),
                   fingerprint=run_fingerprint(data), warnings=warnings)
    if data.eval is None:
        return plan_sft(train_rows=train_rows, layout=layout, loop=loop, epoch_batches=train.epoch_batches,
                        info=info)
    eval_packing = config.packing if config.eval_packing is None else config.eval_packing
    evaluated = stream.read_eval(data.eval, args, _stream_reader(data.eval, data.tokenizer, config,
                                                                 packing=eval_packing, name="eval"),
                                 _stream_check(config, "eval"))
    return plan_sft(train_rows=train_rows, layout=layout, loop=loop, epoch_batches=train.epoch_batches,
                    info=info, eval_rows=stream.sft_rows(evaluated.rows), eval_batches=evaluated.batches,
                    eval_steps=eval_steps_of(args, loop))


def _stream_reader(dataset: Any, tokenizer: Any, config: Any, *, packing: bool,
                   name: str) -> stream.Read[stream.PreparedRow]:
    """How a rank's stream of `dataset` yields its prepared rows."""
    trainer = _preparer(dataset, tokenizer, config, packing=packing)

    def read(part: Any, limit: int | None, reader: stream.Reader, epoch: int) -> Iterator[stream.PreparedRow]:
        with trl_preparing(name):
            yield from stream.prepared_rows(part, tokenizer, config, trainer, packing=packing, name=name,
                                            reader=reader, epoch=epoch, limit=limit)
    return read


def _stream_check(config: Any, name: str) -> Callable[[int], None]:
    def check(rows: int) -> None:
        if not rows:
            raise DatasetError(f"every row of the {name} stream was dropped: no row keeps a trainable token within "
                               f"max_length={config.max_length}; raise --max_length or check the loss masks")
    return check
