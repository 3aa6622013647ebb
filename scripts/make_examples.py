"""Regenerate the bundled offline examples: a tiny Qwen3-style model and tokenizer, a tiny Qwen2.5-VL built on the
same tokenizer, small Capybara-style (`messages`) and tldr-style (`prompt`) datasets, and the vision demo's four
small images and the `messages` rows that reference them (`make demo-vision`).

Run from the repository root: `python scripts/make_examples.py`. The output is committed, so
`make demo`, `make demo-vision` and the tests need neither this script nor the Hub.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import trl
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent / "examples"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
           "<tool_response>", "</tool_response>"]
WORDS = (  # noqa: SIM905  (a sentence reads better than a list of 90 quoted words)
         "the model learns to answer every question with care and detail while the trainer pads each batch "
         "to a multiple of one hundred twenty eight tokens so that trainium compiles a graph once and reuses it "
         "many times during a long run on a cluster of accelerators users ask about math code stories recipes "
         "travel history science music and their favourite books").split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(sentence(rng, rng.randint(4, 14)) for _ in range(rng.randint(lo, hi)))


def make_tokenizer(path: Path) -> None:
    rng = random.Random(0)
    corpus = [text(rng, 1, 8) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=template, model_max_length=32768)
    fast.save_pretrained(path)


def make_model(path: Path) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def make_vision_model(text_model: Path, path: Path) -> None:
    """A random Qwen2.5-VL (one decoder layer, one vision block) on the text model's tokenizer plus the vision
    tokens, TRL's Qwen2.5-VL chat template, and a Qwen2-VL image processor with a small max_pixels (202 patches
    of 28x28 at most), so that big images are downscaled as real checkpoints downscale huge ones."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = PreTrainedTokenizerFast.from_pretrained(text_model)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5_vl.jinja").read_text()
    tok.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=158368).save_pretrained(path)
    ids = {token: tok.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                     "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}, "tie_word_embeddings": True,
                     "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": None},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                       "fullatt_block_indexes": [0]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(path)


def make_datasets() -> None:
    rng = random.Random(1)
    with open(ROOT / "capybara-sample.jsonl", "w") as f:
        for _ in range(96):
            messages = []
            for _ in range(rng.choice([1, 1, 1, 2, 3])):
                messages.append({"role": "user", "content": text(rng, 1, 4)})
                messages.append({"role": "assistant", "content": text(rng, 1, 12)})
            f.write(json.dumps({"source": "synthetic", "messages": messages}) + "\n")
    with open(ROOT / "tldr-sample.jsonl", "w") as f:
        for _ in range(64):
            post = text(rng, 2, 16)
            f.write(json.dumps({"prompt": f"SUBREDDIT: r/AskReddit\nTITLE: {sentence(rng, 6)}\nPOST: {post}\nTL;DR:",
                                "completion": " " + sentence(rng, rng.randint(5, 20))}) + "\n")


# The vision demo's images: (name, width, height), four aspect ratios, each a few hundred bytes of PNG.
VISION_IMAGES = [("square", 224, 224), ("wide", 448, 252), ("tall", 196, 336), ("small", 112, 84)]
VISION_COLOURS = [(200, 40, 40), (40, 120, 200), (60, 160, 80), (230, 180, 40)]


def make_vision_demo() -> None:
    """examples/vision-demo/*.png and examples/vision-sample.jsonl: 24 `messages` rows of one or two of the images
    each, referenced by paths relative to the repository root (where `make demo-vision` runs). Deterministic: the
    images are drawn, not sampled, and Pillow writes no timestamp into a PNG."""
    from PIL import Image, ImageDraw

    folder = ROOT / "vision-demo"
    folder.mkdir(exist_ok=True)
    paths = []
    for (name, width, height), colour in zip(VISION_IMAGES, VISION_COLOURS, strict=True):
        image = Image.new("RGB", (width, height), (235, 235, 235))
        draw = ImageDraw.Draw(image)
        draw.rectangle((width // 6, height // 6, width * 5 // 6, height * 5 // 6), fill=colour)
        draw.ellipse((width // 3, height // 3, width * 2 // 3, height * 2 // 3), fill=(250, 250, 250))
        image.save(folder / f"{name}.png", optimize=True)
        paths.append(f"examples/vision-demo/{name}.png")
    rng = random.Random(2)
    with open(ROOT / "vision-sample.jsonl", "w") as f:
        for _ in range(24):
            images = rng.sample(paths, rng.choice([1, 1, 1, 2]))
            messages = [{"role": "user", "content": "What is in " + ("these images?" if len(images) > 1 else
                                                                     "this image?")},
                        {"role": "assistant", "content": text(rng, 1, 3)}]
            f.write(json.dumps({"messages": messages, "images": images}) + "\n")


if __name__ == "__main__":
    model_dir = ROOT / "tiny-qwen3"
    model_dir.mkdir(parents=True, exist_ok=True)
    make_tokenizer(model_dir)
    make_model(model_dir)
    make_vision_model(model_dir, ROOT / "tiny-qwen2.5-vl")
    make_datasets()
    make_vision_demo()
