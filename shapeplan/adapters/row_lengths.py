"""The data's token lengths as the trainer tokenizes them, untruncated: for histograms and advice."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import UsageError
from .common import RunData, apply_chat_template_path, load_run_data
from .generation_stream import is_stream
from .trainer import TrainerSpec
from .trl_args import TrainingArgs, planning_args
from .vision import is_vision

# the options under which the prepared train rows are the untruncated ones
UNTRUNCATED = (("max_length", "none"), ("packing", "false"))


def train_lengths(spec: TrainerSpec, argv: Sequence[str], *, eval_source: str | None = None,
                  use_cache: bool = True) -> tuple[int, ...]:
    """What `spec.lengths` names (the services refuse a method with none): the prepared train rows without
    max_length or packing (through the length cache, so the plans that follow re-derive theirs from the same
    tokenization), or the train prompts."""
    untruncated = [word for pair in UNTRUNCATED for word in (f"--{pair[0]}", pair[1])]
    args = planning_args(spec, [*argv, *untruncated] if spec.lengths == "rows" else list(argv))
    return lengths_of(args, eval_source=eval_source, use_cache=use_cache)


def lengths_of(args: TrainingArgs, *, eval_source: str | None = None, use_cache: bool = True) -> tuple[int, ...]:
    """`train_lengths` of a run already read (for rows: under `UNTRUNCATED`)."""
    spec = args.spec
    if spec.lengths == "rows":
        from .sft import prepare_rows

        data = _whole_data(args, eval_source)
        apply_chat_template_path(data.tokenizer, args.training.chat_template_path)
        rows, _ = prepare_rows(data.train, data.tokenizer, args.training, packing=False, name="train",
                               use_cache=use_cache)
        return rows.lengths
    from .generation import bare_trainer, prompt_lengths

    data = _whole_data(args, eval_source)
    return prompt_lengths(data.train, bare_trainer(spec, data.tokenizer, args.training, args.agentic), "train")


def _whole_data(args: TrainingArgs, eval_source: str | None) -> RunData:
    """The run's data, refused when streamed (lengths cover every row, which a stream gives only read whole) and when
    it has images (`advise` weighs image sizes for those, see services/vision_advice.py)."""
    data = load_run_data(args, eval_source=eval_source, vision=True)
    if is_vision(data.train):
        raise UsageError("--histogram shows text lengths, which do not decide a vision run's compiles; `shapeplan "
                         "advise` shows its vision graphs and the image sizes that make them few")
    if is_stream(data.train):
        raise UsageError("--histogram and advise read the length of every train row, which a stream gives only when "
                         "read whole; drop --dataset_streaming for them (the map-style run has the same lengths)")
    return data
