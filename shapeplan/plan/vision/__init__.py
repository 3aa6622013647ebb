"""Images as each vision-language family's processor turns them into device inputs: one module per family (pure
arithmetic over image sizes and the processor's settings, `family.ImageFamily`; its what-ifs are its `settings`),
the what-ifs every family shares in `whatif`, and `FAMILIES`, each planned `config.model_type`'s family."""

from .family import ImageFamily
from .gemma3 import Gemma3Images
from .idefics3 import Idefics3Images
from .llava import LlavaImages
from .llava_next import LlavaNextImages
from .qwen2_vl import Grid, ImageProcessing, ImageSizeError, pixel_rows
from .whatif import FixedSizes, fixed_sizes_of, pixels_kept_by

FAMILIES: dict[str, type[ImageFamily]] = {
    model_type: family
    for family in (ImageProcessing, Gemma3Images, Idefics3Images, LlavaImages, LlavaNextImages)
    for model_type in family.MODEL_TYPES
}

__all__ = ["FAMILIES", "FixedSizes", "Gemma3Images", "Grid", "Idefics3Images", "ImageFamily", "ImageProcessing",
           "ImageSizeError", "LlavaImages", "LlavaNextImages", "fixed_sizes_of", "pixel_rows", "pixels_kept_by"]
