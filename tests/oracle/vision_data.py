"""Vision-language datasets for the tests, in the formats TRL reads: image files of many sizes and modes (tiny ones
the processor upscales, huge ones it downscales, grayscale, RGBA, palette, a JPEG turned by its EXIF orientation),
and rows that reference them by path."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

# (width, height, mode): the processor's grid depends on the size only; the modes check that conversion keeps it
IMAGES = [(20, 12, "RGB"), (3000, 2000, "RGB"), (300, 301, "L"), (500, 300, "RGBA"), (90, 200, "P"),
          (224, 224, "RGB"), (64, 640, "RGB"), (1000, 30, "LA")]
ROTATED = (400, 100)  # a JPEG stored 400x100 with EXIF orientation 6: 100x400 once turned


def write_images(folder: Path) -> list[str]:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (width, height, mode) in enumerate(IMAGES):
        path = folder / f"image{i}.png"
        Image.new(mode, (width, height)).save(path)
        paths.append(str(path))
    rotated = Image.new("RGB", ROTATED, (200, 10, 10))
    exif = rotated.getexif()
    exif[0x0112] = 6
    path = folder / "rotated.jpg"
    rotated.save(path, exif=exif)
    paths.append(str(path))
    return paths


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(["the", "image", "shows", "a", "red", "square", "on", "grey"])
                    for _ in range(rng.randint(lo, hi)))


def write_rows(path: Path, images: list[str], rows: int, *, seed: int, kind: str = "messages") -> Path:
    """`rows` rows of 0 to 2 images each (`images` column; `image`: exactly one), as `messages` or as `text` with
    the image placeholders written by the user."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            chosen = [rng.choice(images)] if kind == "image" else rng.sample(images, rng.choice([0, 1, 1, 2]))
            row: dict[str, Any]
            if kind == "text":
                marks = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in chosen)
                row = {"text": marks + _words(rng, 2, 40), "images": chosen}
            else:
                row = {"messages": [{"role": "user", "content": _words(rng, 1, 30)},
                                    {"role": "assistant", "content": _words(rng, 1, 60)}]}
                row.update({"image": chosen[0]} if kind == "image" else {"images": chosen})
            f.write(json.dumps(row) + "\n")
    return path
