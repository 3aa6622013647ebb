"""Reading a processor's settings as its `__call__` resolves them, for every family's `from_processor`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def call_settings(processor: Any) -> Mapping[str, Any]:
    """The images kwargs the processor passes its image processor at call (its class defaults and its
    `from_pretrained` kwargs, kept in tokenizer_config.json), which beat the image processor's own attributes."""
    merged = processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs)
    return dict(merged["images_kwargs"])


def setting(image_processor: Any, overrides: Mapping[str, Any], name: str) -> Any:
    """A setting as the image processor's `preprocess` resolves it: the processor's call kwargs first."""
    return overrides[name] if name in overrides else getattr(image_processor, name, None)


def size_key(size: Any, key: str) -> Any:
    """A key of a processor's `size` / `crop_size`: a SizeDict (attributes) or a plain dict (as call kwargs give it)."""
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def whole(subject: str, name: str, value: Any, fix: str = "set it in preprocessor_config.json") -> int:
    """A setting the arithmetic divides or multiplies by: a whole number of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{subject}'s {name} is {value!r}, not a whole number of at least 1; {fix}")
    return value
