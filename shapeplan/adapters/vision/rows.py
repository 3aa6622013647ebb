"""A vision dataset's rows as TRL's `DataCollatorForVisionLanguageModeling` will process them: each row's rendered
text tokenized once, one placeholder per image, and each image's size; the collated lengths then follow from the
family's arithmetic (`plan.vision_rows`), each placeholder counted as the tokens its image expands to."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ...errors import DatasetError, UsageError, first_line
from ...plan.rows import Rows
from ...plan.vision import FixedSizes
from ...plan.vision_rows import CutImageTokens, ImageRow, image_rows
from .images import _row_images, image_size, undecoded
from .processor import VisionProcessor


def read_rows(dataset: Any, vision: VisionProcessor, config: Any, *, name: str) -> tuple[ImageRow, ...]:
    """Each row's rendered tokens and image sizes (every image decoded once, as the run decodes it)."""
    return tuple(iter_rows(undecoded(dataset), vision, config, name=name))


def iter_rows(examples: Iterable[dict[str, Any]], vision: VisionProcessor, config: Any, *,
              name: str) -> Iterator[ImageRow]:
    """`read_rows` lazily, over rows as they come (a stream's, its Image features left undecoded by `undecoded`)."""
    template = _training_template(vision, config)
    for index, example in enumerate(examples):
        sizes = tuple(_size(vision, image, index, name) for image in _row_images(example, index, name))
        yield _image_row(vision, _row_texts(vision, example, len(sizes), config, index, name, template), sizes,
                         index, name)


def prompt_rows(dataset: Any, vision: VisionProcessor, trainer: Any, *, name: str) -> tuple[ImageRow, ...]:
    """A vision-language GRPO / RLOO dataset's prompts as the trainer's `_tokenize_prompts` tokenizes them: each row's
    conversational prompt with an image part per image (`prepare_multimodal_messages`), rendered with the
    generation prompt by the processor's chat template, each image's placeholder expanded to its tokens; and each
    row's grids. Never truncated (GRPO keeps whole prompts)."""
    from trl.data_utils import is_conversational, prepare_multimodal_messages

    rows = []
    for index, example in enumerate(undecoded(dataset)):
        sizes = tuple(_size(vision, image, index, name) for image in _row_images(example, index, name))
        prompt = example.get("prompt")
        if not is_conversational({"prompt": prompt}):
            raise DatasetError(f"row {index} of the {name} dataset has images and a prompt that is not a list of "
                               "messages, which the trainer refuses (multimodal training requires conversational "
                               "prompts: ValueError); give the prompt as messages")
        try:
            text = vision.processor.apply_chat_template(
                prepare_multimodal_messages(prompt, images=[None] * len(sizes)), tools=trainer.tools or None,
                chat_template=getattr(trainer, "chat_template", None), add_generation_prompt=True, tokenize=False,
                **trainer.chat_template_kwargs)
        except (ValueError, TypeError, KeyError) as exc:
            raise DatasetError(f"row {index} of the {name} dataset cannot be rendered with its images: "
                               f"{first_line(exc)}; fix the row") from None
        rows.append(_image_row(vision, [text], sizes, index, name))
    return tuple(rows)


def collated_rows(rows: tuple[ImageRow, ...], vision: VisionProcessor, config: Any, *, name: str,
                  resize: FixedSizes | None = None) -> Rows:
    """The rows as the collator pads them (`resize`: with every image resized to one of those sizes first)."""
    try:
        return image_rows(rows, vision.family, vision.tokens, config.max_length, resize)
    except CutImageTokens as exc:
        raise DatasetError(f"row {exc.row} of the {name} dataset has {exc.length} tokens with its image tokens, and "
                           f"max_length={config.max_length} cuts into them (TRL's forward then fails); raise "
                           "--max_length, or lower the processor's max_pixels") from None


def _size(vision: VisionProcessor, image: Any, index: int, name: str) -> tuple[int, int]:
    try:
        height, width = image_size(image)
        vision.family.image(height, width)  # refused here, with the row and the file, if the processor refuses it
        return height, width
    except ValueError as exc:  # ImageSizeError among them
        shown = image if isinstance(image, str) and len(image) < 200 else (
            image.get("path") if isinstance(image, dict) and image.get("path") else type(image).__name__)
        raise DatasetError(f"row {index} of the {name} dataset: image {shown!r} cannot be used: {exc}; fix or "
                           "drop the row") from None


def _training_template(vision: VisionProcessor, config: Any) -> str | None:
    """The chat template `SFTTrainer.__init__` gives the collator: with `assistant_only_loss` and a template without
    generation markers, TRL's training variant of it (which renders other text), else None (the processor's)."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if not config.assistant_only_loss or has_generation_markers(vision.processor.chat_template):
        return None
    try:
        template: str | None = get_training_chat_template(vision.processor)
    except ValueError as exc:
        raise UsageError(f"assistant_only_loss needs a chat template with generation markers, and TRL has no "
                         f"training variant of this one ({first_line(exc)}); pass --chat_template_path with a "
                         "template that marks the assistant turns, or drop --assistant_only_loss") from None
    return template


def _row_texts(vision: VisionProcessor, example: dict[str, Any], images: int, config: Any, index: int,
               name: str, template: str | None = None) -> list[str]:
    """The row's text as the collator tokenizes it, one placeholder per image: one text, or a prompt-completion
    row's two (`template`: the collator's chat template, where it is not the processor's)."""
    from trl.data_utils import prepare_multimodal_messages

    processor = vision.processor
    if "messages" in example:
        try:
            messages = prepare_multimodal_messages(example["messages"], images=[None] * images)
            texts = [processor.apply_chat_template(messages, chat_template=template, tokenize=False)]
        except (ValueError, TypeError, KeyError) as exc:
            raise DatasetError(f"row {index} of the {name} dataset cannot be rendered with its images: "
                               f"{first_line(exc)}; fix the row") from None
    elif "prompt" in example and "completion" in example:
        texts = _prompt_completion(processor, example, images, config, index, name)
    elif isinstance(example.get(config.dataset_text_field), str):
        texts = [example[config.dataset_text_field]]
    else:
        raise DatasetError(f"row {index} of the {name} dataset has images but neither 'messages', 'prompt' and "
                           f"'completion', nor a text column {config.dataset_text_field!r}; vision rows need one "
                           "of them")
    return texts


def _image_row(vision: VisionProcessor, texts: list[str], sizes: tuple[tuple[int, int], ...], index: int,
               name: str) -> ImageRow:
    """A row of these texts (tokenized apart and joined, as the prompt-completion collator does) and images: its
    tokens, one placeholder per image, and the placeholders' positions."""
    tokenizer = vision.processor.tokenizer
    ids = [token for text in texts for token in tokenizer(text, add_special_tokens=False)["input_ids"]]
    positions = [i for i, token in enumerate(ids) if token == vision.placeholder_id]
    if len(positions) != len(sizes):
        raise DatasetError(f"row {index} of the {name} dataset has {len(sizes)} images and {len(positions)} "
                           f"{vision.placeholder} tokens in its text; give each image one")
    return ImageRow(tokens=_row_tokens(vision, texts, sizes, len(ids)), placeholders=tuple(positions), sizes=sizes)


def _row_tokens(vision: VisionProcessor, texts: list[str], sizes: tuple[tuple[int, int], ...], tokens: int) -> int:
    """The row's `tokens` (one per placeholder), or, where its images' expansions merge with its text (Gemma 3's
    newlines), what its texts with each placeholder replaced as the processor replaces it tokenize to, less what the
    expansions add: the merges counted in the row's last text run."""
    family = vision.family
    if not family.MERGES_WITH_TEXT or not sizes:
        return tokens
    keys = iter([family.image(h, w) for h, w in sizes])
    tokenizer, placeholder = vision.processor.tokenizer, vision.placeholder
    whole = added = 0
    for text in texts:
        parts = text.split(placeholder)
        expanded = parts[0]
        for part in parts[1:]:
            key = next(keys)
            expanded += family.expansion(key, vision.processor) + part
            added += vision.tokens(key) - 1
        whole += len(tokenizer(expanded, add_special_tokens=False)["input_ids"])
    return whole - added


def _prompt_completion(processor: Any, example: dict[str, Any], images: int, config: Any, index: int,
                       name: str) -> list[str]:
    """A prompt-completion row's prompt and completion texts as `_collate_prompt_completion` forms them (a
    conversational row rendered by TRL's `apply_chat_template`). It tokenizes the two apart and joins them;
    `flush_left` then removes the prompt's left padding, so a row is its prompt's tokens followed by its
    completion's, and a batch is as long as its longest row."""
    from trl.data_utils import apply_chat_template, is_conversational, prepare_multimodal_messages

    prompt, completion = example["prompt"], example["completion"]
    if is_conversational(example):
        kept = {"prompt": prepare_multimodal_messages(prompt, images=[None] * images),
                "completion": prepare_multimodal_messages(completion)}
        if not config.remove_unused_columns and "chat_template_kwargs" in example:
            kept["chat_template_kwargs"] = example["chat_template_kwargs"]
        try:
            rendered = apply_chat_template(kept, processor)
        except (ValueError, TypeError, KeyError) as exc:
            raise DatasetError(f"row {index} of the {name} dataset cannot be rendered with its images: "
                               f"{first_line(exc)}; fix the row") from None
        prompt, completion = rendered["prompt"], rendered["completion"]
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DatasetError(f"row {index} of the {name} dataset has a prompt or completion that is neither text nor "
                           "a list of messages; fix the row")
    return [prompt, completion]
