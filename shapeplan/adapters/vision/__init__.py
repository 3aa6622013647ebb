"""Vision-language runs as TRL will process them, without processing them: the images' sizes (`images`), the
model's processor and its family's arithmetic (`processor`), each row's tokens and images (`rows`). TRL does not
prepare (tokenize) a vision dataset: its collator runs the processor on every batch."""

from .images import fetch, image_columns, image_size, is_vision, resize_images, undecoded
from .processor import VisionProcessor, load_processor, run_processor, vision_config
from .rows import collated_rows, iter_rows, prompt_rows, read_rows

__all__ = ["VisionProcessor", "collated_rows", "fetch", "image_columns", "image_size", "is_vision", "iter_rows",
           "load_processor", "prompt_rows", "read_rows", "resize_images", "run_processor",
           "undecoded", "vision_config"]
