"""The vision-language oracle: a real `SFTTrainer` run on CPU with the bundled tiny Qwen2.5-VL, recording what the
model receives (pixel batches and image grids included) through the guard's recorder."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shapeplan.guard.recorder import Forward
from tests.conftest import TINY_VL_MODEL
from tests.oracle.harness import _parse, load_data

Key = tuple[Any, ...]


def processor(model: Path = TINY_VL_MODEL) -> Any:
    """The model's processor as `from_pretrained` loads it (its image processor, tokenizer and chat template, by
    transformers' own rules, not shapeplan's), without the video processor (transformers builds that with
    torchvision, whose wheels here do not load against the CPU torch; image batches do not use it)."""
    from transformers import AutoConfig, Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    model_type = AutoConfig.from_pretrained(model).model_type
    if model_type not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        from tests.oracle.vision_tiling import processor as family_processor

        return family_processor(model)
    base = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}.get(model_type, Qwen2VLProcessor)

    class ImageOnly(base):  # type: ignore[misc, valid-type]  # the model type's processor class, chosen above
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                     **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImageOnly.from_pretrained(model)


def run_sft_vision(train_path: Path, argv: Sequence[str], *, eval_path: Path | None = None,
                   images: str | None = None, model: Path = TINY_VL_MODEL, guard: Any = None,
                   streaming: bool = False, guarded: bool = True) -> list[Forward]:
    """Train with `trl sft`'s parser on `argv`; `images`: cast that column to `datasets` Image features first (as a
    Hub dataset holds them), else the rows keep their paths; `streaming`: the data as IterableDatasets;
    `guarded=False`: without the guard (which reads each batch's mask on the host: an op of its own on CPU)."""
    import torch
    from transformers import AutoModelForImageTextToText
    from trl import SFTTrainer

    from shapeplan import ShapeGuard

    torch.set_num_threads(1)
    _, config, *_ = _parse("sft", [
        "--output_dir", "/tmp/shapeplan-oracle", "--report_to", "none", "--use_cpu", "true",
        "--save_strategy", "no", "--logging_steps", "1000", "--bf16", "false", "--disable_tqdm", "true", *argv])

    def load(path: Path) -> Any:
        return _load(path, streaming=streaming, images=images)

    vlm = AutoModelForImageTextToText.from_pretrained(model, dtype="float32")
    seen: list[Forward] = []
    guard = guard or ShapeGuard(on_unplanned="record")
    guard.on_forward = seen.append
    trainer = SFTTrainer(model=vlm, args=config, train_dataset=load(train_path),
                         eval_dataset=load(eval_path) if eval_path else None, processing_class=processor(model),
                         callbacks=[guard] if guarded else None)
    trainer.train()
    return seen


def _load(path: Path, *, streaming: bool = False, images: str | None = None) -> Any:
    """A JSONL file or a `save_to_disk` folder, as `trl <method>` loads it; `images`: that column cast to `datasets`
    Image features."""
    import datasets

    if (path / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(path))
    data = load_data(path, streaming)
    if images == "images":
        return data.cast_column("images", datasets.List(datasets.Image()))
    if images == "image":
        return data.cast_column("image", datasets.Image())
    return data


def run_generation_vision(method: str, train_path: Path, argv: Sequence[str], *, eval_path: Path | None = None,
                          guard: Any = None, model: Path = TINY_VL_MODEL) -> list[Forward]:
    """Train `method`'s trainer (GRPO, RLOO) on the tiny Qwen2.5-VL with `trl <method>`'s parser on `argv` (a length
    reward)."""
    import importlib

    import torch
    from transformers import AutoModelForImageTextToText

    from shapeplan import ShapeGuard
    from shapeplan.services.trainers import TRAINERS

    parser = importlib.import_module(TRAINERS[method].script).make_parser()
    _, config, *_ = parser.parse_args_and_config([
        "--output_dir", "/tmp/shapeplan-oracle", "--report_to", "none", "--use_cpu", "true", "--save_strategy", "no",
        "--logging_steps", "1000", "--bf16", "false", "--disable_tqdm", "true", *argv], return_remaining_strings=True)
    vlm = AutoModelForImageTextToText.from_pretrained(model, dtype="float32")
    seen: list[Forward] = []
    guard = guard or ShapeGuard(on_unplanned="record")
    guard.on_forward = seen.append

    def length(completions: list[Any], **kwargs: Any) -> list[float]:
        return [float(len(c)) for c in completions]

    loaded = processor(model)
    loaded.tokenizer.padding_side = "left"  # as the trainer loads a processor itself (AutoProcessor, padding left)
    trainer = TRAINERS[method].trainer()(model=vlm, reward_funcs=[length], args=config,
                                         train_dataset=_load(train_path),
                                         eval_dataset=_load(eval_path) if eval_path else None,
                                         processing_class=loaded, callbacks=[guard])
    torch.set_num_threads(1)
    trainer.train()
    return seen


def observed(seen: Sequence[Forward]) -> dict[Key, tuple[int, int, Any]]:
    """(phase, batch, seq, cache_len, images) -> (count, first step, pixel_values)."""
    keys = [(s.phase, s.batch, s.seq, s.cache_len, s.images) for s in seen]
    counts = Counter(keys)
    out: dict[Key, tuple[int, int, Any]] = {}
    for key, s in zip(keys, seen, strict=True):
        prior = out.get(key)
        out[key] = (counts[key], min(prior[1], s.step) if prior else s.step, s.pixel_values)
    return out


def planned(plan: Any) -> dict[Key, tuple[int, int, Any]]:
    return {(s.phase, s.batch, s.seq, s.cache_len, s.images): (s.count, s.first_step, s.pixel_values)
            for s in plan.shapes}
