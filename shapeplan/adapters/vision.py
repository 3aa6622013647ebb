"""Vision-language rows as TRL's `DataCollatorForVisionLanguageModeling` will process them: each row's token length
with its image tokens, and each image's grid, from the model's own processor settings and chat template.

TRL does not prepare (tokenize) a vision dataset: the collator runs the processor on every batch. This reads the
same inputs without processing them: each image is decoded once, as the run decodes it (a file that cannot be fails
here), its size turned by its EXIF orientation (as `load_image` and `datasets` turn it), the grid from `plan.vision`
(transformers' `smart_resize`), and a row's length from the rendered template tokenized once, each `<|image_pad|>`
counted as the tokens its grid expands to. An image URL is fetched within a time and a size bound
(`SHAPEPLAN_IMAGE_TIMEOUT`, `SHAPEPLAN_IMAGE_MAX_MIB`), which `load_image` does not have.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import math
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import DatasetError, ModelError, UsageError, first_line
from ..plan.rows import Rows
from ..plan.vision import FixedSizes, ImageProcessing, PixelLimits
from ..plan.vision.family import ImageFamily, ImageKey
from ..plan.vision_rows import CutImageTokens, ImageRow, image_rows

# The processors whose image arithmetic `plan.vision` reproduces (Qwen2.5-VL and Qwen3-VL use Qwen2-VL's image
# processor, Qwen3-VL with 16-pixel patches).
PLANNED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_EXIF_ORIENTATION = 0x0112
_SWAPPED = {5, 6, 7, 8}  # orientations exif_transpose turns by 90 degrees: height and width swap
# transformers' `load_image` fetches a URL with no timeout and reads the whole body: a server that never answers
# hangs the run, an endless body exhausts its memory. shapeplan fetches within these (docs/bounds.md).
IMAGE_TIMEOUT_S = 30.0
IMAGE_MAX_MIB = 64.0


def image_columns(dataset: Any) -> list[str]:
    """The dataset's `image` / `images` columns, which make it a vision dataset for TRL (`SFTTrainer.__init__`: the
    first row has an `image` or `images` key)."""
    from trl.data_utils import get_dataset_column_names

    return sorted({"image", "images"} & set(get_dataset_column_names(dataset)))


def is_vision(dataset: Any) -> bool:
    return bool(image_columns(dataset))


@dataclass(frozen=True)
class VisionProcessor:
    """The run's processor, as far as shapes go: its family's image arithmetic under its settings, and the text
    side that renders the rows and expands each image's placeholder."""

    family: ImageFamily
    processor: Any  # the model's processor without its video processor (it needs torchvision, which planning does not)
    _tokens: dict[ImageKey, int] = field(default_factory=dict, compare=False, repr=False)

    def tokens(self, key: ImageKey) -> int:
        """The tokens an image of this key puts in the text: its expansion as the processor writes it, tokenized
        (once per key)."""
        if key not in self._tokens:
            text = self.family.expansion(key, self.processor)
            self._tokens[key] = len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._tokens[key]

    def with_family(self, family: ImageFamily) -> VisionProcessor:
        """This processor under other image settings (a what-if)."""
        return replace(self, family=family, _tokens={})

    @property
    def placeholder(self) -> str:
        """The token the chat template writes for an image, which the processor expands."""
        return str(getattr(self.processor, self.family.PLACEHOLDER))

    @property
    def placeholder_id(self) -> int:
        return int(self.processor.tokenizer.convert_tokens_to_ids(self.placeholder))


def load_processor(model: str, tokenizer: Any, *, revision: str | None = None, trust_remote_code: bool = False,
                   chat_template_path: str | None = None) -> VisionProcessor:
    """The processor `AutoProcessor.from_pretrained(model)` builds for a model shapeplan plans images for; its video
    processor left out (transformers builds it with torchvision, which image shapes do not need). Its chat template
    is the processor's own (`chat_template.jinja`, or a legacy `chat_template.json`), as `AutoProcessor` reads it,
    or with `chat_template_path` (a .jinja file, which SFTTrainer sets on the processor) the tokenizer's, which
    holds that file already."""
    model_type, image_processor, settings = image_processing(model, revision=revision,
                                                             trust_remote_code=trust_remote_code)
    template = tokenizer.chat_template if chat_template_path else _processor_template(model, revision)
    processor = _image_only(model_type)(image_processor=image_processor, tokenizer=tokenizer,
                                        chat_template=template or tokenizer.chat_template)
    return VisionProcessor(family=settings, processor=processor)


def image_processing(model: str, *, revision: str | None = None, trust_remote_code: bool = False
                     ) -> tuple[str, Any, ImageProcessing]:
    """The model's type, its image processor (as `AutoProcessor` builds it) and the settings its grids follow from,
    each checked: a model shapeplan plans images for, a processor that converts to RGB, settings it can resize by."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the model config of {model}: {first_line(exc)}; vision-language runs need "
                         "the model's config.json") from exc
    model_type = getattr(config, "model_type", None)
    if model_type not in PLANNED_MODEL_TYPES:
        raise UsageError(f"the dataset has images, and {model} is a {model_type!r} model, whose processor shapeplan "
                         f"does not plan images for (it plans {', '.join(PLANNED_MODEL_TYPES)}); plan a Qwen2-VL, "
                         "Qwen2.5-VL or Qwen3-VL model, or drop the image columns")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    try:
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(model, revision=revision or "main")
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the image processor of {model}: {first_line(exc)}; a vision-language model "
                         "needs its preprocessor_config.json") from exc
    if not getattr(image_processor, "do_convert_rgb", True):
        raise UsageError(f"{model}'s image processor keeps each image's channels (do_convert_rgb false), so the "
                         "pixel rows of a grayscale or RGBA image differ from an RGB one's; shapeplan plans processors "
                         "that convert to RGB")
    size: Any = image_processor.size  # a SizeDict once built, whichever keys the config used
    values = {"min_pixels": _whole(model, "min_pixels (size.shortest_edge)", getattr(size, "shortest_edge", None)),
              "max_pixels": _whole(model, "max_pixels (size.longest_edge)", getattr(size, "longest_edge", None)),
              **{name: _whole(model, name, getattr(image_processor, name, None))
                 for name in ("patch_size", "merge_size", "temporal_patch_size")}}
    if values["min_pixels"] > values["max_pixels"]:
        raise ModelError(f"{model}'s image processor has min_pixels {values['min_pixels']} above max_pixels "
                         f"{values['max_pixels']}, which no image can be resized within; fix its "
                         "preprocessor_config.json")
    return model_type, image_processor, ImageProcessing(**values)


def qwen_family(family: ImageFamily) -> ImageProcessing:
    """The family of a what-if on Qwen-VL's pixel limits (`smart_resize`'s min_pixels and max_pixels), which other
    families do not have."""
    if not isinstance(family, ImageProcessing):
        raise UsageError("pixel-limit what-ifs resize images as Qwen-VL's processor does (min_pixels, max_pixels); "
                         "this model's processor has no such limits")
    return family


def _whole(model: str, name: str, value: Any) -> int:
    """A processor setting the resize divides or multiplies by: a whole number of at least 1 (0, -5 or NaN would
    fail the arithmetic, blamed on the first image)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1 \
            or value != int(value):
        raise ModelError(f"{model}'s image processor has {name} {value!r}, not a whole number of at least 1; fix it "
                         "in its preprocessor_config.json")
    return int(value)


def run_processor(args: Any, tokenizer: Any) -> VisionProcessor:
    """`load_processor` for a run's parsed arguments (`TrainingArgs`): its model, revision, trust_remote_code and,
    where the method has one, chat_template_path."""
    config = args.training
    return load_processor(args.model.model_name_or_path or "", tokenizer, revision=args.model.model_revision,
                          trust_remote_code=bool(getattr(config, "trust_remote_code", False)),
                          chat_template_path=getattr(config, "chat_template_path", None))


def whatif_config(resize: FixedSizes | None, limits: PixelLimits | None) -> dict[str, Any]:
    """What a plan records of an image what-if: the fixed sizes every image is resized to, the pixel limits."""
    recorded: dict[str, Any] = {}
    if resize is not None:
        recorded["fixed_image_sizes"] = [list(size) for size in resize.sizes]
    if limits is not None:
        recorded["pixel_limits"] = {"min_pixels": limits.min_pixels, "max_pixels": limits.max_pixels}
    return recorded


def _processor_template(model: str, revision: str | None) -> Any:
    """The chat template `AutoProcessor` gives the processor (None where the folder has none of its own)."""
    from transformers import ProcessorMixin

    try:
        processor_dict, _ = ProcessorMixin.get_processor_dict(model, revision=revision)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the processor files of {model}: {first_line(exc)}") from exc
    return processor_dict.get("chat_template")


def _image_only(model_type: str) -> type:
    """The model type's processor class with the video processor taken out of its signature, so that transformers
    neither expects nor builds one."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    base = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}.get(model_type, Qwen2VLProcessor)

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(f"ImageOnly{base.__name__}", (base,), {"__init__": __init__})


# -- image sizes -----------------------------------------------------------------------------------------------------

def _open(source: bytes | str) -> Any:
    """An image file (its bytes or its path), opened lazily: only the header is read."""
    from PIL import Image

    return Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)


def _decoded_size(data: bytes | str) -> tuple[int, int]:
    """(height, width) of an image file after `ImageOps.exif_transpose`. Its pixels are decoded (`load`), as the run's
    image loading decodes them: a truncated or corrupt file fails here, not in the run's collator (`verify` reads
    a JPEG's markers only, and passes a file cut in its data)."""
    with _open(data) as image:
        image.load()
        width, height = image.size
        turned = image.getexif().get(_EXIF_ORIENTATION) in _SWAPPED
    return (width, height) if turned else (height, width)


def _setting(name: str, default: float, high: float) -> float:
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= high:  # NaN too
        raise UsageError(f"{name}={text!r} is not a number above 0 and at most {high:g}; set e.g. {default:g} or "
                         "unset it")
    return value


def fetch(url: str) -> bytes:
    """The file at an image URL, as `load_image` fetches it (redirects followed), waiting SHAPEPLAN_IMAGE_TIMEOUT
    seconds at most for the server's answer and as long for the whole file, of SHAPEPLAN_IMAGE_MAX_MIB at most;
    raises ValueError with what went wrong, naming the setting that bounds it."""
    timeout = _setting("SHAPEPLAN_IMAGE_TIMEOUT", IMAGE_TIMEOUT_S, 3600)
    limit = int(_setting("SHAPEPLAN_IMAGE_MAX_MIB", IMAGE_MAX_MIB, 1 << 20) * (1 << 20))
    slow = ValueError(f"no whole answer within {timeout:g} s (SHAPEPLAN_IMAGE_TIMEOUT; raise it for a slow server)")
    large = ValueError(f"over {limit / (1 << 20):g} MiB (SHAPEPLAN_IMAGE_MAX_MIB; raise it for larger images)")
    deadline = time.monotonic() + timeout
    data = bytearray()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > limit:
                raise large
            # each wait for the server within what is left of the whole fetch: a server sending a byte at a time
            # would otherwise hold every read below the timeout
            sock = getattr(getattr(response.fp, "raw", None), "_sock", None)
            while chunk := _read(response, sock, deadline, slow):
                data += chunk
                if len(data) > limit:
                    raise large
    except urllib.error.HTTPError as exc:
        raise ValueError(f"the server answered HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise slow from None
        raise ValueError(f"cannot fetch it ({exc.reason})") from None
    except TimeoutError:  # socket.timeout too
        raise slow from None
    except (http.client.HTTPException, OSError) as exc:  # a broken answer, a reset connection, TLS
        raise ValueError(f"cannot fetch it ({first_line(exc, named=True)})") from None
    return bytes(data)


def _read(response: Any, sock: socket.socket | None, deadline: float, slow: ValueError) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise slow
    if sock is not None:
        sock.settimeout(left)
    return bytes(response.read1(1 << 16))


def image_size(value: Any) -> tuple[int, int]:
    """The (height, width) the processor resizes from, for an image as a dataset row holds it: a PIL image (as
    `datasets` decodes it: already turned), the {"bytes", "path"} of an undecoded `datasets` Image, or a string,
    which transformers' `load_image` reads as a URL, a file path or base64, and turns. Raises ValueError with the
    reason it cannot be opened."""
    from PIL import Image, UnidentifiedImageError

    try:
        if isinstance(value, Image.Image):
            return value.height, value.width
        if isinstance(value, dict) and ("bytes" in value or "path" in value):
            source = value.get("bytes") or value.get("path")
            if not source:
                raise ValueError("an Image value with neither bytes nor path")
            return _decoded_size(source)
        if isinstance(value, str):
            if value.startswith(("http://", "https://")):
                return _decoded_size(fetch(value))
            if os.path.isfile(value):
                return _decoded_size(value)
            if os.path.isdir(value):
                raise ValueError("a folder, not an image file")
            if value.startswith("data:image/"):
                value = value.split(",", 1)[-1]
            try:
                data = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("no such file") from None
            try:
                return _decoded_size(data)
            except UnidentifiedImageError:  # a missing file's name that is base64 too ("data"): a path, most likely
                raise ValueError("no such file (nor base64 of an image)") from None
    except FileNotFoundError:
        raise ValueError("no such file") from None
    except UnidentifiedImageError:
        raise ValueError("not an image PIL can open") from None
    except Image.DecompressionBombError:  # Pillow refuses it in the run's processor too
        raise ValueError(f"over Pillow's decompression-bomb limit ({2 * (Image.MAX_IMAGE_PIXELS or 0):,} pixels), "
                         "which the run's image loading refuses as well") from None
    except (OSError, SyntaxError) as exc:  # a known format whose data is truncated or corrupt
        raise ValueError(f"a corrupt image ({first_line(exc)})") from None
    raise ValueError(f"a {type(value).__name__}, not an image, a path, a URL or base64")


def undecoded(dataset: Any) -> Any:
    """The dataset with its `datasets` Image columns left undecoded: `image_size` decodes each as the run does."""
    import datasets

    features = getattr(dataset, "features", None) or {}
    for column in ("image", "images"):
        feature = features.get(column)
        if isinstance(feature, datasets.Image):
            dataset = dataset.cast_column(column, datasets.Image(decode=False))
        elif isinstance(feature, (datasets.Sequence, datasets.List)) and isinstance(feature.feature, datasets.Image):
            dataset = dataset.cast_column(column, type(feature)(datasets.Image(decode=False)))
    return dataset


def _row_images(example: dict[str, Any], index: int, name: str) -> list[Any]:
    if "image" in example:
        return [] if example["image"] is None else [example["image"]]
    images = example.get("images") or []
    if not isinstance(images, (list, tuple)):
        raise DatasetError(f"row {index} of the {name} dataset has an 'images' value that is a "
                           f"{type(images).__name__}, not a list of images; give a list (or use an 'image' column)")
    return list(images)


# -- fewer sizes -----------------------------------------------------------------------------------------------------

def resize_images(dataset: Any, sizes: Any) -> Any:
    """`dataset` with every image of a row (`image` or `images`) resized to the one of `sizes`, (height, width)
    pairs as `shapeplan advise` lists them, with the nearest aspect ratio: the processor then keeps each image's
    size, so the run meets only those grids. A `datasets.map` over the rows, stored as `datasets` Image features.

        import shapeplan
        dataset = shapeplan.resize_images(dataset, [(448, 448), (336, 588)])

    Images are read as the run reads them (a path, URL or base64 with `load_image`, which turns them by EXIF), and
    resized with Pillow's bicubic filter, the processor's own."""
    import datasets

    try:
        fixed = FixedSizes(tuple((int(h), int(w)) for h, w in sizes))
    except (TypeError, ValueError):
        raise UsageError("resize_images takes (height, width) pairs, as `shapeplan advise` lists them") from None
    if not fixed.sizes or any(h < 1 or w < 1 for h, w in fixed.sizes):
        raise UsageError("resize_images needs at least one (height, width) pair of positive sides")
    features = dataset.features.copy() if dataset.features is not None else None
    columns = [c for c in ("image", "images") if c in (dataset.column_names or ())]
    if features is not None:
        for column in columns:  # rows of no image first would leave the type to guess: it is an image
            features[column] = datasets.Image() if column == "image" else datasets.List(datasets.Image())

    def resize(row: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "image" in columns:
            out["image"] = None if row["image"] is None else _resized(row["image"], fixed)
        if "images" in columns:
            out["images"] = [_resized(image, fixed) for image in row["images"] or []]
        return out

    return dataset.map(resize, features=features)


def _resized(value: Any, fixed: FixedSizes) -> Any:
    from PIL import Image, ImageOps
    from transformers.image_utils import load_image

    if isinstance(value, Image.Image):
        image = value  # as `datasets` decodes it: already turned
    elif isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        image = ImageOps.exif_transpose(_open(value.get("bytes") or value["path"]))
    elif isinstance(value, str) and value.startswith(("http://", "https://")):
        image = load_image(_open(fetch(value)))  # bounded, then turned as load_image turns it
    else:
        image = load_image(value)
    height, width = fixed.target(image.height, image.width)
    return image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)


# -- rows ------------------------------------------------------------------------------------------------------------

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
    return ImageRow(tokens=len(ids), placeholders=tuple(positions), sizes=sizes)


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
