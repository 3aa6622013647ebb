"""The image arithmetic the vision planner reproduces, equal to transformers' own: the processor's grid for every
size (`smart_resize` and patchify), and an image's size as the run's processor reads it (EXIF orientation, modes)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from shapeplan.errors import PlanFileError
from shapeplan.plan.io import plan_from_dict, plan_to_dict
from shapeplan.plan.model import Plan, PlanStats, Shape
from shapeplan.plan.vision import ImageProcessing, ImageSizeError, pixel_rows
from tests.oracle.vision_data import write_images

SIDES = [1, 13, 27, 28, 29, 55, 56, 100, 224, 333, 448, 1000, 1023, 4096]


@pytest.mark.parametrize(("min_pixels", "max_pixels"), [(3136, 1003520), (12544, 50176), (3136, 12845056)])
def test_grids_equal_the_image_processor(min_pixels: int, max_pixels: int) -> None:
    """Every (height, width) of SIDES: transformers' `smart_resize`, and for the small ones the image processor
    itself, its images row, its pixel_values rows and width, and the image tokens its processor writes."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

    processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    ours = ImageProcessing(min_pixels=min_pixels, max_pixels=max_pixels)
    for height, width in itertools.product(SIDES, SIDES):
        if max(height, width) / min(height, width) > 200:
            with pytest.raises(ImageSizeError):
                ours.grid(height, width)
            continue
        resized = smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
        assert ours.resized(height, width) == resized, (height, width)
        if height * width > 100_000:
            continue
        out = processor(images=[Image.new("RGB", (width, height))], return_tensors="np")
        grid = ours.grid(height, width)
        assert [list(grid)] == out["image_grid_thw"].tolist(), (height, width)
        assert (pixel_rows([grid]), ours.pixel_dim) == out["pixel_values"].shape
        assert ours.tokens(grid) == int(out["image_grid_thw"].prod()) // processor.merge_size ** 2


def test_image_sizes_are_read_as_the_run_reads_them(tmp_path: Path) -> None:
    """From the header of each file (grayscale, RGBA, palette, a JPEG turned by EXIF), as a path, as bytes of an
    undecoded `datasets` Image and as base64: the size `load_image` gives the processor."""
    import base64

    from transformers.image_utils import load_image

    from shapeplan.adapters.vision import image_size

    for path in write_images(tmp_path):
        loaded = load_image(path)
        expected = (loaded.height, loaded.width)
        data = Path(path).read_bytes()
        assert image_size(path) == image_size({"bytes": data, "path": None}) == expected, path
        assert image_size(base64.b64encode(data).decode()) == expected
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    truncated = Path(write_images(tmp_path / "more")[1]).read_bytes()
    (tmp_path / "truncated.png").write_bytes(truncated[:len(truncated) // 2])
    from PIL import Image

    Image.new("1", (20000, 10000)).save(tmp_path / "bomb.png")  # 2e8 pixels in a few kB: over Pillow's limit
    for value, reason in ((str(tmp_path / "corrupt.png"), "not an image"), (str(tmp_path / "missing.png"), "no such"),
                          (str(tmp_path / "truncated.png"), "corrupt"), (str(tmp_path / "bomb.png"), "bomb"),
                          (3, "not an image, a path")):
        with pytest.raises(ValueError, match=reason):
            image_size(value)


def test_a_vision_shape_round_trips_through_the_plan_file() -> None:
    grids = ((1, 4, 6), (1, 22, 34))
    shape = Shape(phase="train", batch=2, seq=256, count=3, first_step=1, pixel_values=(pixel_rows(grids), 1176),
                  images=grids)
    plan = Plan(method="sft", exact=True, pad_to_multiple_of=128, shapes=(shape,),
                stats=PlanStats(rows=6, dropped_rows=0, micro_batches=3, optimizer_steps=3, tokens=1, padded_tokens=1))
    data = plan_to_dict(plan)
    assert data["shapes"][0]["pixel_values"] == [772, 1176]
    assert data["shapes"][0]["image_grid_thw"] == [[1, 4, 6], [1, 22, 34]]
    assert plan_from_dict(data).shapes == (shape,)
    data["shapes"][0]["pixel_values"] = [771, 1176]
    with pytest.raises(PlanFileError, match="patches"):
        plan_from_dict(data)


def test_fixed_sizes_are_labelled_height_x_width() -> None:
    """A fixed size reads height x width, the order of the (height, width) pairs `resize_images` takes."""
    from shapeplan.plan.vision import FixedSizes

    assert FixedSizes(((224, 448),)).label == "1 fixed size (224x448)"
    assert FixedSizes(((448, 224), (224, 448))).label == "2 fixed sizes (448x224, 224x448)"


def test_fixed_sizes_are_kept_by_the_processor_and_chosen_by_aspect() -> None:
    """Qwen-VL's what-ifs (`settings`), from the images' own distribution: each fixed size is one the processor
    leaves as it is (so a resized image has exactly that grid), an image goes to the size of nearest aspect ratio;
    pixel limits cap below the current one; pixels kept count downscaling only."""
    from shapeplan.plan.vision import FixedSizes, pixels_kept_by

    processing = ImageProcessing(min_pixels=3136, max_pixels=158368)
    sizes = [(h, w) for h in (12, 200, 301, 640, 2000) for w in (20, 90, 300, 500, 3000)
             if max(h, w) / min(h, w) <= 200]
    for count in (1, 2, 3, 4):
        fixed = processing.fixed_sizes(sizes, count)
        assert 1 <= len(fixed) <= count
        assert all(processing.resized(h, w) == (h, w) for h, w in fixed)
    fixed = FixedSizes(processing.fixed_sizes(sizes, 3))
    tall, wide = min(fixed.sizes, key=lambda s: s[1] / s[0]), max(fixed.sizes, key=lambda s: s[1] / s[0])
    assert fixed.target(2000, 20) == tall and fixed.target(12, 3000) == wide
    (one, *_) = processing.settings([(56, 56), (560, 560)])
    assert one.sizes == processing.fixed_sizes([(56, 56), (560, 560)], 1) and one.family == processing
    assert one.apply == f"dataset = shapeplan.resize_images(dataset, [{one.sizes[0]}])"
    assert pixels_kept_by([(56, 56)], processing, one) == 1.0  # upscaled: nothing lost
    big = processing.resized(560, 560)
    assert pixels_kept_by([(560, 560)], processing, one) == pytest.approx(
        one.sizes[0][0] * one.sizes[0][1] / (big[0] * big[1]))

    # pixel limits from the same images: caps below the current one, each a multiple of the factor squared, then
    # one area for all; each the family under those limits; only downscaling loses pixels
    limits = [setting for setting in processing.settings(sizes) if setting.pixel_limits is not None]
    caps = [lim for lim in limits if lim.pixel_limits[0] < lim.pixel_limits[1]]
    assert caps and all(lim.pixel_limits[1] < processing.max_pixels and lim.pixel_limits[1] % 28 ** 2 == 0
                        for lim in caps)
    assert all((lim.family.min_pixels, lim.family.max_pixels) == lim.pixel_limits for lim in limits)
    equal = limits[-1]
    assert equal.pixel_limits[0] == equal.pixel_limits[1] and equal.label.startswith("min_pixels = max_pixels = ")
    assert all(0 < pixels_kept_by(sizes, processing, lim) < 1 for lim in limits)
    assert pixels_kept_by([(56, 56)], processing, caps[0]) == 1.0
