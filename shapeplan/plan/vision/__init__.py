"""Images as each vision-language family's processor turns them into device inputs: one module per family (pure
arithmetic over image sizes and the processor's settings), the what-ifs that fix their sizes in `whatif`."""

from .qwen2_vl import Grid, ImageProcessing, ImageSizeError, pixel_rows
from .whatif import FixedSizes, PixelLimits, fixed_sizes, pixel_limits, pixels_kept, pixels_kept_under

__all__ = ["FixedSizes", "Grid", "ImageProcessing", "ImageSizeError", "PixelLimits", "fixed_sizes", "pixel_limits",
           "pixel_rows", "pixels_kept", "pixels_kept_under"]
