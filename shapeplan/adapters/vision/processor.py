"""The run's processor as far as shapes go: the model's own processor (its video processor left out: transformers
builds that with torchvision, which image shapes do not need), and its family's image arithmetic under its settings
(`plan.vision`)."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ...errors import ModelError, UsageError, first_line
from ...plan.vision import FAMILIES
from ...plan.vision.family import ImageFamily, ImageKey, Setting


@dataclass(frozen=True)
class VisionProcessor:
    """The run's processor, as far as shapes go: its family's image arithmetic under its settings, and the text
    side that renders the rows and expands each image's placeholder."""

    model_type: str
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
    """The processor `AutoProcessor.from_pretrained(model)` builds for a model shapeplan plans images for (its image
    processor with the PIL backend, the processor's own settings from `processor_config.json`), its video processor
    left out, and its family's arithmetic under its settings. Its chat template is the processor's own
    (`chat_template.jinja`, or a legacy `chat_template.json`), as `AutoProcessor` reads it, or with
    `chat_template_path` (a .jinja file, which SFTTrainer sets on the processor) the tokenizer's, which holds that
    file already."""
    model_type = _model_type(model, revision=revision, trust_remote_code=trust_remote_code)
    family = FAMILIES.get(model_type or "")
    if family is None:
        raise UsageError(f"the dataset has images, and {model} is a {model_type!r} model, whose processor shapeplan "
                         f"does not plan images for (it plans {', '.join(FAMILIES)}); plan one of those, or drop the "
                         "image columns")
    image_processor = _image_processor(model, revision)
    settings = _processor_dict(model, revision)
    template = tokenizer.chat_template if chat_template_path else settings.get("chat_template")
    base = _processor_class(model_type or "")
    named = set(inspect.signature(base.__init__).parameters) - {"self", "image_processor", "tokenizer",
                                                                 "video_processor", "chat_template", "kwargs"}
    try:
        processor = _image_only(base, model, revision)(image_processor=image_processor, tokenizer=tokenizer,
                                      chat_template=template or tokenizer.chat_template,
                                      **{name: value for name, value in settings.items() if name in named})
        return VisionProcessor(model_type=model_type or "", family=family.from_processor(processor),
                               processor=processor)
    except ImportError as exc:  # SmolVLM's processor will not build without num2words, in the run either
        raise UsageError(f"{model}'s processor needs a package that is not installed: {first_line(exc)}") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelError(f"{model}'s {first_line(exc)}") from None


def _model_type(model: str, *, revision: str | None, trust_remote_code: bool) -> str | None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the model config of {model}: {first_line(exc)}; vision-language runs need "
                         "the model's config.json") from exc
    return getattr(config, "model_type", None)


def _image_processor(model: str, revision: str | None) -> Any:
    """The model's image processor with the PIL backend (the torchvision one gives the same sizes; its wheels need
    not load), checked to convert every image to RGB."""
    from transformers import AutoImageProcessor

    try:
        image_processor = AutoImageProcessor.from_pretrained(model, revision=revision or "main", backend="pil")
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the image processor of {model}: {first_line(exc)}; a vision-language model "
                         "needs its preprocessor_config.json") from exc
    if not getattr(image_processor, "do_convert_rgb", True):
        raise UsageError(f"{model}'s image processor keeps each image's channels (do_convert_rgb false), so the "
                         "pixel values of a grayscale or RGBA image differ from an RGB one's; shapeplan plans "
                         "processors that convert to RGB")
    return image_processor


def run_processor(args: Any, tokenizer: Any) -> VisionProcessor:
    """`load_processor` for a run's parsed arguments (`TrainingArgs`): its model, revision, trust_remote_code and,
    where the method has one, chat_template_path. A script that hands its trainer a processor of its own (script
    mode) is planned with that one, its settings as it holds them (pan-and-scan, image splitting)."""
    config = args.training
    model = args.model.model_name_or_path or ""
    trust = bool(getattr(config, "trust_remote_code", False))
    given = args.objects.processing_class if getattr(args, "objects", None) is not None else None
    if given is not None and getattr(given, "image_processor", None) is not None:
        model_type = _model_type(model, revision=args.model.model_revision, trust_remote_code=trust)
        family = FAMILIES.get(model_type or "")
        if family is None:
            raise UsageError(f"the dataset has images, and {model} is a {model_type!r} model, whose processor "
                             f"shapeplan does not plan images for (it plans {', '.join(FAMILIES)})")
        try:
            return VisionProcessor(model_type=model_type or "", family=family.from_processor(given), processor=given)
        except (ValueError, TypeError, KeyError) as exc:
            raise ModelError(f"the script's processor cannot be planned: {first_line(exc)}") from None
    return load_processor(model, tokenizer, revision=args.model.model_revision, trust_remote_code=trust,
                          chat_template_path=getattr(config, "chat_template_path", None))


def vision_config(vision: VisionProcessor, setting: Setting | None) -> dict[str, Any]:
    """What a plan records of its images: the model type whose family made its keys (`plan.vision.FAMILIES`), the
    tensors its processor adds to every batch shaped as input_ids (Gemma 3's token_type_ids), and of an image
    what-if (`setting`) the fixed sizes every image is resized to, the pixel limits."""
    recorded: dict[str, Any] = {"vision_family": vision.model_type}
    if vision.family.TEXT_INPUTS:  # on every batch, images or not, shaped as its input_ids
        recorded["text_inputs"] = list(vision.family.TEXT_INPUTS)
    if setting is not None and setting.sizes:
        recorded["fixed_image_sizes"] = [list(size) for size in setting.sizes]
    if setting is not None and setting.pixel_limits is not None:
        low, high = setting.pixel_limits
        recorded["pixel_limits"] = {"min_pixels": low, "max_pixels": high}
    return recorded


def _processor_dict(model: str, revision: str | None) -> dict[str, Any]:
    """The processor's own settings (`processor_config.json`) and chat template, as `AutoProcessor` reads them."""
    from transformers import ProcessorMixin

    try:
        processor_dict, _ = ProcessorMixin.get_processor_dict(model, revision=revision)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the processor files of {model}: {first_line(exc)}") from exc
    return dict(processor_dict)


def _processor_class(model_type: str) -> Any:
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    return processor_class_from_name(PROCESSOR_MAPPING_NAMES[model_type])


def _image_only(base: Any, model: str, revision: str | None) -> Any:
    """`base` with its video processor taken out of its signature (where it has one), so that transformers neither
    expects nor builds one (it needs torchvision, which image shapes do not); a processor whose chat template reads
    the video processor's frame settings (SmolVLM's) finds them on a stand-in."""
    if "video_processor" not in inspect.signature(base.__init__).parameters:
        return base
    frames = _video_settings(model, revision)

    def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        self.video_processor = SimpleNamespace(num_frames=frames.get("num_frames"), fps=frames.get("fps"))

    return type(f"ImageOnly{base.__name__}", (base,), {"__init__": __init__})


def _video_settings(model: str, revision: str | None) -> dict[str, Any]:
    """The video processor's own settings (`video_preprocessor_config.json`), read as JSON; {} where it has none."""
    from transformers.utils import cached_file

    try:
        path = cached_file(model, "video_preprocessor_config.json", revision=revision,
                           _raise_exceptions_for_missing_entries=False)
        settings = json.loads(Path(path).read_text()) if path else {}
    except (OSError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}
