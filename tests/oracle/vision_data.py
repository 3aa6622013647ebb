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
    """`rows` rows of 0 to 2 images each (`images` column; `image`: exactly one), as `messages`, as `text` with
    the image placeholders written by the user, or as `prompt-completion` (conversational) or
    `prompt-completion-text` (the placeholders in the prompt text)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            chosen = [rng.choice(images)] if kind == "image" else rng.sample(images, rng.choice([0, 1, 1, 2]))
            row: dict[str, Any]
            marks = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in chosen)
            if kind == "text":
                row = {"text": marks + _words(rng, 2, 40), "images": chosen}
            elif kind == "prompt-completion":
                row = {"prompt": [{"role": "user", "content": _words(rng, 1, 30)}],
                       "completion": [{"role": "assistant", "content": _words(rng, 1, 60)}], "images": chosen}
            elif kind == "prompt-completion-text":
                row = {"prompt": marks + _words(rng, 1, 30), "completion": " " + _words(rng, 1, 60),
                       "images": chosen}
            else:
                row = {"messages": [{"role": "user", "content": _words(rng, 1, 30)},
                                    {"role": "assistant", "content": _words(rng, 1, 60)}]}
                row.update({"image": chosen[0]} if kind == "image" else {"images": chosen})
            f.write(json.dumps(row) + "\n")
    return path


def _another_vl_model(folder: Path, source: Path, build: Any, processor: dict[str, Any]) -> Path:
    """A copy of `source` (its tokenizer, chat template and image processor) with another model: `build(base, ids)`
    makes the random model from the source's config and its vision token ids; `processor` updates the image
    processor's settings."""
    import shutil

    import torch
    from transformers import AutoConfig

    shutil.copytree(source, folder)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (folder / name).unlink()
    base = AutoConfig.from_pretrained(source)
    tokens = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    torch.manual_seed(0)
    build(base, {name: getattr(base, name) for name in tokens}).save_pretrained(folder)
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**settings, **processor}))
    return folder


def write_qwen2_vl(folder: Path, source: Path) -> Path:
    """A random tiny Qwen2-VL (`qwen2_vl`) with `source`'s text decoder config, vision token ids, tokenizer, chat
    template and image processor, and other pixel limits."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    def build(base: Any, ids: dict[str, int]) -> Any:
        return Qwen2VLForConditionalGeneration(Qwen2VLConfig(
            text_config=base.text_config.to_dict(),
            vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 32, "mlp_ratio": 2, "num_heads": 2,
                           "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
            tie_word_embeddings=True, **ids))
    return _another_vl_model(folder, source, build, {"size": {"shortest_edge": 6272, "longest_edge": 90000}})


def write_structured_rows(path: Path, images: list[str], rows: int, *, seed: int) -> Path:
    """Rows of structured content (a list of typed parts): a system turn, two exchanges, the images placed by the
    user in the second user turn."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            chosen = rng.sample(images, rng.choice([0, 1, 2]))

            def text(lo: int, hi: int) -> list[dict[str, str]]:
                return [{"type": "text", "text": _words(rng, lo, hi)}]
            messages = [{"role": "system", "content": text(1, 5)}, {"role": "user", "content": text(1, 20)},
                        {"role": "assistant", "content": text(1, 20)},
                        {"role": "user", "content": [*({"type": "image"} for _ in chosen), *text(1, 20)]},
                        {"role": "assistant", "content": text(1, 40)}]
            f.write(json.dumps({"messages": messages, "images": chosen}) + "\n")
    return path


def write_qwen3_vl(folder: Path, source: Path) -> Path:
    """A random tiny Qwen3-VL (`qwen3_vl`: 16-pixel patches, so 1536-wide patch rows, and its own processor class)
    with `source`'s tokenizer, vision token ids, chat template and image processor."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    def build(base: Any, ids: dict[str, int]) -> Any:
        text = base.text_config
        return Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config={"vocab_size": text.vocab_size, "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                         "pad_token_id": text.pad_token_id, "eos_token_id": text.eos_token_id,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                             "mrope_section": [1, 1, 2], "mrope_interleaved": True}},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 16,
                           "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 32,
                           "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
            tie_word_embeddings=True, **ids))
    return _another_vl_model(folder, source, build,
                             {"patch_size": 16, "size": {"shortest_edge": 8192, "longest_edge": 131072}})


def write_prompts(path: Path, images: list[str], rows: int, *, seed: int) -> Path:
    """GRPO rows: a conversational prompt and 1 or 2 images each."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"prompt": [{"role": "user", "content": _words(rng, 1, 30)}],
                                "images": rng.sample(images, rng.choice([1, 1, 2]))}) + "\n")
    return path
