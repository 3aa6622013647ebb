"""Tiny random vision-language models of the tiling families, built offline from transformers' own classes: SmolVLM
(`smolvlm`, or `idefics3`: 32-pixel tiles, 128-pixel longest edge, so 1 to 17 frames an image) and LLaVA-NeXT
(`llava_next`: 32-pixel patches, pinpoints of 1 to 3 patches a side). Each folder holds the model, its image
processor, a tokenizer derived from the repo's tiny Qwen3 one with the family's special tokens, and the family's
chat template, so that `AutoConfig`, the family's processor and `AutoModelForImageTextToText` load it offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.conftest import TINY_MODEL

TILE = 32  # SmolVLM's frame side and LLaVA-NeXT's patch side: small, so a CPU step stays quick
SMOLVLM_IMAGE_SEQ_LEN = 4  # (TILE / 8)**2 vision patches, pixel-shuffled by 2x2
# SmolVLM's and Idefics3's template as their checkpoints ship it (`processing_smolvlm.DEFAULT_CHAT_TEMPLATE`, which
# takes string contents too)
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}"
    "{% endif %}")
# llava-v1.6-mistral-7b-hf's template, its `</s>` the tiny tokenizer's end of turn
LLAVA_NEXT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<<SYS>>\n' + message['content'][0]['text'] "
    "+ '\n<</SYS>>\n\n' }}{% elif message['role'] == 'user' %}{{ '[INST] ' }}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'][0]['text'] + '<|im_end|> '}}{% else %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ ' ' }}{% endif %}")
LLAVA_NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]  # the 336-pixel checkpoints', / 10.5


def _tokenizer(tokens: list[str]) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    return tokenizer


def _text_config(tokenizer: Any) -> dict[str, Any]:
    return {"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": None}


def write_smolvlm(folder: Path, *, model_type: str = "smolvlm", splitting: bool = True) -> Path:
    """A random tiny SmolVLM (or Idefics3 with `model_type="idefics3"`): a one-layer SigLIP-style tower on 32-pixel
    frames of 8-pixel patches, 4 image tokens a frame, a one-layer Llama decoder."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    tokens = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
              *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
    tokenizer = _tokenizer(tokens)
    config, model = {"smolvlm": (SmolVLMConfig, SmolVLMForConditionalGeneration),
                     "idefics3": (Idefics3Config, Idefics3ForConditionalGeneration)}[model_type]
    torch.manual_seed(0)
    model(config(
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": TILE, "patch_size": 8},
        text_config=_text_config(tokenizer), scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        **{"pad_token_id": tokenizer.pad_token_id})).save_pretrained(folder)  # a kwarg the config pops
    tokenizer.save_pretrained(folder)
    processor_class = {"smolvlm": "SmolVLMProcessor", "idefics3": "Idefics3Processor"}[model_type]
    name = processor_class.replace("Processor", "ImageProcessor")
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": name, "processor_class": processor_class, "do_image_splitting": splitting,
        "size": {"longest_edge": 4 * TILE}, "max_image_size": {"longest_edge": TILE}, "resample": 1,
        "do_convert_rgb": True, "do_pad": True, "do_resize": True, "do_rescale": True, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": processor_class,
                                                              "image_seq_len": SMOLVLM_IMAGE_SEQ_LEN}))
    if model_type == "smolvlm":  # what a SmolVLM2 checkpoint ships besides (transformers builds it with torchvision)
        (folder / "video_preprocessor_config.json").write_text(json.dumps({
            "video_processor_type": "SmolVLMVideoProcessor", "processor_class": processor_class,
            "max_image_size": {"longest_edge": TILE}, "size": {"longest_edge": 4 * TILE}, "fps": 1,
            "num_frames": 64}))
    (folder / "chat_template.jinja").write_text(SMOLVLM_TEMPLATE)
    return folder


def write_llava_next(folder: Path) -> Path:
    """A random tiny LLaVA-NeXT: a one-layer CLIP tower on 32-pixel patches of 8-pixel cells (16 features a patch,
    its CLS dropped: the "default" strategy), a one-layer Llama decoder, pinpoints of 1x2 to 3x1 patches."""
    import torch
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    tokenizer = _tokenizer(["<image>"])
    torch.manual_seed(0)
    LlavaNextForConditionalGeneration(LlavaNextConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": TILE, "patch_size": 8,
                       "projection_dim": 16},
        text_config=_text_config(tokenizer), image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        vision_feature_select_strategy="default", vision_feature_layer=-1,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), image_seq_length=16,
        tie_word_embeddings=True)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor",
        "aspect_ratio_setting": "anyres", "crop_size": {"height": TILE, "width": TILE}, "size": {"shortest_edge": TILE},
        "image_grid_pinpoints": LLAVA_NEXT_PINPOINTS, "do_center_crop": True, "do_convert_rgb": True,
        "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True, "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaNextProcessor", "patch_size": 8, "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1, "image_token": "<image>"}))
    (folder / "chat_template.jinja").write_text(LLAVA_NEXT_TEMPLATE)
    return folder


def processor(folder: Path) -> Any:
    """The folder's processor as `AutoProcessor` loads it, with PIL image processors. A SmolVLM one without its
    video processor and num2words: transformers builds that with torchvision, whose wheels do not load here, and
    needs num2words (not installed) for video prompts only; `apply_chat_template` reads the video processor's
    frame count and fps, so a stand-in holds them."""
    from transformers import AutoConfig, AutoProcessor, SmolVLMProcessor
    from transformers.models.smolvlm import processing_smolvlm

    if AutoConfig.from_pretrained(folder).model_type != "smolvlm":
        return AutoProcessor.from_pretrained(folder, backend="pil")
    if processing_smolvlm.num2words is None:
        def no_videos(number: int) -> str:
            raise AssertionError("the tiling tests process no videos")
        processing_smolvlm.num2words = no_videos
    settings = json.loads((folder / "video_preprocessor_config.json").read_text())

    class ImageOnly(SmolVLMProcessor):
        # the settings named, as `from_pretrained` passes a processor only the keys its `__init__` names
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, image_seq_len: int = 169,
                     chat_template: Any = None, **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, None, image_seq_len=image_seq_len,
                             chat_template=chat_template, **kwargs)
            self.video_processor = SimpleNamespace(num_frames=settings["num_frames"], fps=settings["fps"])

    return ImageOnly.from_pretrained(folder, backend="pil")
