"""Tiny random vision-language models of the families beyond Qwen, built offline from transformers' own config,
model, image processor and processor classes (never from the Hub): a folder each that `AutoConfig`,
`AutoProcessor` and `AutoModelForImageTextToText` load, and that TRL's `SFTTrainer` trains.

Their tokenizers are the repository's tiny byte-level BPE (examples/tiny-qwen3) with the family's special tokens
added, and merges for runs of newlines, as real vocabularies have ("\\n\\n", "\\n\\n\\n"): Gemma 3's image text starts
and ends with "\\n\\n", which then merges with the newlines around it, as it does with the real tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import TINY_MODEL

GEMMA3_SIDE = 64  # the image processor's size: 8x8 patches of 8 pixels, pooled 2x2 to 16 image tokens
GEMMA3_TOKENS = 16
# LLaVA-1.5's chat template, as llava-hf/llava-1.5-7b-hf ships it (chat_template.json)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
LLAVA_SIDE = 56  # CLIP crop: 4x4 patches of 14 pixels, + CLS dropped by the "default" strategy: 16 image tokens
NEWLINES = ("ĊĊ", "ĊĊĊ", "ĊĊĊĊ")  # byte-level BPE spelling of "\n\n", "\n\n\n", "\n\n\n\n"


def _tokenizer(folder: Path, added: list[str], **special: Any) -> Any:
    """The tiny tokenizer with newline-run merges, the `added` special tokens and the `special` init kwargs
    (bos_token=..., extra_special_tokens=..., or processor settings, which tokenizer_config.json keeps), saved to
    `folder` and loaded back."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    data = json.loads((TINY_MODEL / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    for token in NEWLINES:
        vocab[token] = len(vocab)
    data["model"]["merges"] = [["Ċ", "Ċ"], ["ĊĊ", "Ċ"], ["ĊĊ", "ĊĊ"], *data["model"]["merges"]]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text((TINY_MODEL / "tokenizer_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder, **special)
    tokenizer.add_tokens(added, special_tokens=True)
    tokenizer.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def write_gemma3(folder: Path, *, pan_and_scan: bool = False) -> Path:
    """A random tiny Gemma 3 (`gemma3`: SigLIP tower on 64x64 images, 16 image tokens, sliding and full attention
    layers) with Gemma 3's special tokens, chat template (the google/gemma-3-*-it one, which TRL keeps) and
    processor; `pan_and_scan`: pan-and-scan on, crops of 32 pixels at least (so that small images are cropped),
    written where the processor reads them at call: in tokenizer_config.json, as `AutoProcessor.from_pretrained(
    model, do_pan_and_scan=True, ...).save_pretrained(...)` writes them (the processor's own defaults, off and 256
    pixels, override the image processor's settings, which hold them too)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from trl.chat_template_utils import gemma3_chat_template

    scan: dict[str, Any] = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32,
                            "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2} \
        if pan_and_scan else {}
    tokenizer = _tokenizer(folder, ["<start_of_turn>"], bos_token="<bos>", eos_token="<end_of_turn>", pad_token="<pad>",
                           extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                 "image_token": "<image_soft_token>"}, **scan)
    image_processor = Gemma3ImageProcessorPil(size={"height": GEMMA3_SIDE, "width": GEMMA3_SIDE}, **scan)
    Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                    chat_template=gemma3_chat_template, image_seq_length=GEMMA3_TOKENS).save_pretrained(folder)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(Gemma3Config(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 16,
                     "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 4096,
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": GEMMA3_SIDE, "patch_size": 8},
        mm_tokens_per_image=GEMMA3_TOKENS, boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id, image_token_index=tokenizer.image_token_id)).save_pretrained(folder)
    return folder


def write_llava(folder: Path) -> Path:
    """A random tiny LLaVA-1.5 (`llava`: CLIP tower on 56x56 crops, a Llama decoder) with LLaVA-1.5's `<image>`
    token, chat template and processor (a CLIP image processor: shortest edge resized to 56, center-cropped)."""
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = _tokenizer(folder, ["<image>"], pad_token="<pad>")
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": LLAVA_SIDE},
                                                         crop_size={"height": LLAVA_SIDE, "width": LLAVA_SIDE}),
                   tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE).save_pretrained(folder)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(LlavaConfig(
        text_config={"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                     "max_position_embeddings": 4096, "pad_token_id": tokenizer.pad_token_id,
                     "eos_token_id": tokenizer.eos_token_id},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": LLAVA_SIDE, "patch_size": 14,
                       "projection_dim": 16},
        image_token_index=image_token, image_seq_length=16, vision_feature_select_strategy="default",
        vision_feature_layer=-2)).save_pretrained(folder)
    return folder
