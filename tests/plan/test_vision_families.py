"""The image arithmetic of the vision-language families beyond Qwen, equal to transformers' own: for images of many
sizes, each family's keys, the text each image expands to (tokenized in its row, as the processor tokenizes it) and
the batch tensors, against what the real processor and TRL's collator return for the tiny offline models of
tests/oracle/vision_families.py."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from shapeplan.plan.vision.gemma3 import Gemma3Images
from shapeplan.plan.vision.llava import LlavaImages
from tests.oracle.vision_families import write_gemma3, write_llava

# (height, width): odd, tall, wide, tiny, large, the processor's own size, and around pan-and-scan's thresholds
SIZES = [(1, 1), (13, 7), (300, 40), (40, 300), (8, 8), (700, 500), (64, 64), (33, 70), (50, 61), (20, 100),
         (100, 310), (1000, 90)]
# rows of a batch: images by index into SIZES (a row of none among them)
BATCHES: list[list[list[int]]] = [[[0], [1, 2], []], [[3, 4], [5]], [[6, 7, 8], [9], [10, 11]], [[2], [3]], [[], []]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {"gemma3": write_gemma3(root / "gemma3"), "gemma3-scan": write_gemma3(root / "scan", pan_and_scan=True),
            "llava": write_llava(root / "llava")}


def _processor(folder: Path, **kwargs: Any) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder, **kwargs)


def _examples(batch: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """Rows as an SFT dataset holds them: messages (the first user turn starts with the images) and images."""
    from PIL import Image

    return [{"messages": [{"role": "user", "content": "what is in the picture " * (i + 1)},
                          {"role": "assistant", "content": "a red square"}],
             "images": [Image.new("RGB", (SIZES[s][1], SIZES[s][0]), (i * 50, 9, 9)) for s in row]}
            for i, row in enumerate(batch)]


def _planned_ids(processor: Any, family: Any, example: dict[str, Any]) -> list[int]:
    """A row's ids as the plan counts them: the rendered text with each image's expansion in place, tokenized
    whole (the expansion's own newlines merge with the text's around it)."""
    from trl.data_utils import prepare_multimodal_messages

    keys = [family.image(image.height, image.width) for image in example["images"]]
    messages = prepare_multimodal_messages(example["messages"], images=[None] * len(keys))
    text = processor.apply_chat_template(messages, tokenize=False)
    placeholder = getattr(processor, family.PLACEHOLDER)
    parts = text.split(placeholder)
    assert len(parts) == len(keys) + 1
    expanded = parts[0] + "".join(family.expansion(key, processor) + part
                                  for key, part in zip(keys, parts[1:], strict=True))
    return list(processor.tokenizer(expanded, add_special_tokens=False)["input_ids"])


def _check_batches(processor: Any, family: Any) -> None:
    """Each batch of BATCHES through TRL's collator: its tensors' names and shapes, and each row's ids, as the
    family plans them."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    collate = DataCollatorForVisionLanguageModeling(processor)
    for batch in BATCHES:
        examples = _examples(batch)
        out = collate(copy.deepcopy(examples))
        keys = [[family.image(image.height, image.width) for image in example["images"]] for example in examples]
        rows, seq = out["input_ids"].shape
        images = any(keys)  # a batch of no image: TRL passes the processor none, and it gives no pixel_values
        assert set(out) == {"input_ids", "attention_mask", "labels", *family.TEXT_INPUTS,
                            *(["pixel_values", *(name for name, _ in family.inputs(keys))] if images else [])}, batch
        if images:
            assert tuple(out["pixel_values"].shape) == family.pixel_values(keys), batch
        for name in family.TEXT_INPUTS:
            assert tuple(out[name].shape) == (rows, seq)
        for name, shape in family.inputs(keys):
            assert tuple(out[name].shape) == shape
        for row, example in enumerate(examples):
            ids = _planned_ids(processor, family, example)
            assert out["input_ids"][row, :len(ids)].tolist() == ids, (batch, row)
            assert int(out["attention_mask"][row].sum()) == len(ids)


class TestGemma3:
    def test_batches_equal_the_collators(self, folders: dict[str, Path]) -> None:
        """Pan-and-scan off (the processor's default) and on: pixel_values [images + crops, 3, 64, 64],
        token_type_ids [B, seq], each row's ids with its images' text."""
        for name, crops in (("gemma3", False), ("gemma3-scan", True)):
            processor = _processor(folders[name])
            family = Gemma3Images.from_processor(processor)
            assert family.pan_and_scan is crops
            assert (family.height, family.width) == (64, 64)
            _check_batches(processor, family)
        scan = Gemma3Images.from_processor(_processor(folders["gemma3-scan"]))
        assert [scan.image(h, w) for h, w in SIZES] == [(0,), (0,), (4,), (4,), (0,), (2,), (0,), (2,), (0,), (0,),
                                                        (3,), (4,)]

    def test_crops_equal_pan_and_scan(self) -> None:
        """`crops` against the image processor's `pan_and_scan` over a grid of sizes and settings."""
        import itertools

        import numpy as np
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        sides = [1, 7, 31, 32, 33, 64, 80, 100, 255, 256, 257, 300, 511, 600, 1030, 1800]
        processor = Gemma3ImageProcessorPil()
        for min_crop, most, ratio in ((256, 4, 1.2), (32, 4, 1.2), (32, 2, 1.0), (100, 8, 2.5)):
            family = Gemma3Images(height=64, width=64, pan_and_scan=True, min_crop_size=min_crop, max_crops=most,
                                  min_ratio=ratio)
            for height, width in itertools.product(sides, sides):
                image = np.zeros((3, height, width), dtype=np.uint8)
                expected = len(processor.pan_and_scan(image, min_crop, most, ratio))
                assert family.crops(height, width) == expected, (height, width, min_crop, most, ratio)
            for crops in {family.crops(h, w) for h, w in itertools.product(sides, sides)}:
                assert family.image(*family.picture((crops,))) == (crops,)

    def test_the_newlines_around_an_image_merge_with_the_text(self, folders: dict[str, Path]) -> None:
        """Each image's text starts and ends with "\\n\\n", which the tokenizer merges with the newlines around it:
        the template's "user\\n" before the first image, the previous image's "\\n\\n" between two. Counted alone,
        each image's text and the row's other text give more tokens than the processor's input_ids, so a row's
        tokens are counted on its text with every expansion in place (as `_planned_ids` counts them)."""
        processor = _processor(folders["gemma3"])
        family = Gemma3Images.from_processor(processor)
        example = _examples([[6, 6]])[0]
        content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "hi"}]
        out = processor.apply_chat_template(
            [[{"role": "user", "content": [{**part, "image": image}
                                           for part, image in zip(content[:2], example["images"], strict=True)]
               + content[2:]}]], tokenize=True, return_dict=True, processor_kwargs={"add_special_tokens": False})
        text = processor.apply_chat_template([[{"role": "user", "content": content}]], tokenize=False)[0]

        def count(text: str) -> int:
            return len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        alone = count(text) - 2 + 2 * count(family.expansion((), processor))
        assert len(out["input_ids"][0]) == count(text.replace("<start_of_image>", family.expansion((), processor)))
        assert len(out["input_ids"][0]) == alone - 1

    def test_pan_and_scan_is_the_processors_call_setting(self, folders: dict[str, Path]) -> None:
        """The processor passes its own pan-and-scan defaults (off) over the image processor's settings: an image
        processor with pan-and-scan on crops nothing, unless the processor is loaded with it on."""
        from PIL import Image
        from transformers import Gemma3Processor
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        plain = _processor(folders["gemma3"])
        image_processor = Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, do_pan_and_scan=True,
                                                  pan_and_scan_min_crop_size=32, pan_and_scan_max_num_crops=4,
                                                  pan_and_scan_min_ratio_to_activate=1.2)
        processor = Gemma3Processor(image_processor=image_processor, tokenizer=plain.tokenizer, image_seq_length=16)
        wide = [Image.new("RGB", (300, 40))]
        assert Gemma3Images.from_image_processor(image_processor).crops(40, 300) == 4
        assert not Gemma3Images.from_processor(processor).pan_and_scan
        assert processor(images=wide, text=["<start_of_image>"], return_tensors="pt")["pixel_values"].shape[0] == 1
        loaded = _processor(folders["gemma3"], do_pan_and_scan=True, pan_and_scan_min_crop_size=32)
        assert Gemma3Images.from_processor(loaded).crops(40, 300) == 4
        assert loaded(images=wide, text=["<start_of_image>"], return_tensors="pt")["pixel_values"].shape[0] == 5

    def test_settings_it_cannot_plan_are_refused(self) -> None:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        scan: dict[str, Any] = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32,
                                "pan_and_scan_max_num_crops": 4, "pan_and_scan_min_ratio_to_activate": 1.2}
        for settings, named in (({"do_resize": False}, "do_resize"), ({"size": {"shortest_edge": 64}}, "size"),
                                ({"do_convert_rgb": False}, "do_convert_rgb"),
                                ({**scan, "pan_and_scan_min_crop_size": 0}, "pan_and_scan_min_crop_size"),
                                ({**scan, "pan_and_scan_min_ratio_to_activate": None}, "min_ratio_to_activate"),
                                ({**scan, "pan_and_scan_max_num_crops": 2.5}, "pan_and_scan_max_num_crops")):
            with pytest.raises(ValueError, match=named):
                Gemma3Images.from_image_processor(Gemma3ImageProcessorPil(**settings))
        assert Gemma3Images.from_image_processor(Gemma3ImageProcessorPil(**scan)).max_crops == 4


class TestLlava:
    def test_batches_equal_the_collators(self, folders: dict[str, Path]) -> None:
        """A CLIP image processor (as llava-hf/llava-1.5-* name): pixel_values [images, 3, 56, 56], 16 tokens."""
        processor = _processor(folders["llava"])
        family = LlavaImages.from_processor(processor)
        assert (family.height, family.width, family.tokens(processor)) == (56, 56, 16)
        _check_batches(processor, family)
        # its expansion is special tokens only, so it merges with nothing: a row counts its text's tokens, each
        # `<image>` as 16
        from trl.data_utils import prepare_multimodal_messages

        for example in _examples(BATCHES[2]):
            messages = prepare_multimodal_messages(example["messages"], images=[None] * len(example["images"]))
            text = processor.apply_chat_template(messages, tokenize=False)
            count = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
            assert count + 15 * len(example["images"]) == len(_planned_ids(processor, family, example))

    def test_other_processors_and_strategies(self, folders: dict[str, Path]) -> None:
        """LLaVA's own image processor padding to a square first, a fixed resize without the crop, and the "full"
        feature strategy (the CLS token kept): shapes and tokens as the processor gives them."""
        from transformers import LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        tokenizer = _processor(folders["llava"]).tokenizer
        for image_processor, strategy, extra, planned in (
                (LlavaImageProcessorPil(do_pad=True, size={"shortest_edge": 42},
                                        crop_size={"height": 42, "width": 42}), "default", 1, (42, 42, 9)),
                (CLIPImageProcessorPil(do_center_crop=False, size={"height": 28, "width": 70}), "full", 1,
                 (28, 70, 11)),
                (CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 45}), "full", 0,
                 (30, 45, 6))):
            processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                       vision_feature_select_strategy=strategy, num_additional_image_tokens=extra)
            family = LlavaImages.from_processor(processor)
            assert (family.height, family.width, family.tokens(processor)) == planned
            from PIL import Image

            images = [Image.new("RGB", (w, h)) for h, w in SIZES]
            out = processor(images=images, text=["<image>" * len(images)], return_tensors="pt")
            assert tuple(out["pixel_values"].shape) == family.pixel_values([[family.image(h, w) for h, w in SIZES]])
            assert out["input_ids"].shape[1] == len(images) * planned[2]

    def test_settings_it_cannot_plan_are_refused(self) -> None:
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        for settings, named in (({"do_center_crop": False}, "do_center_crop"),
                                ({"do_center_crop": False, "do_resize": False}, "do_center_crop"),
                                ({"crop_size": {"height": 0, "width": 56}}, "crop_size")):
            with pytest.raises(ValueError, match=named):
                LlavaImages.from_image_processor(CLIPImageProcessorPil(**settings))


@pytest.mark.parametrize("name", ["gemma3", "gemma3-scan", "llava"])
def test_sft_trains_on_the_planned_batch(folders: dict[str, Path], name: str) -> None:
    """TRL's SFTTrainer trains the tiny model a step on four rows in one batch (so the sampler's order does not
    matter): the forward gets the tensors the family plans, seq the longest planned row."""
    import datasets
    import torch
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(1)
    processor = _processor(folders[name])
    family: Any = Gemma3Images.from_processor(processor) if name.startswith("gemma3") else \
        LlavaImages.from_processor(processor)
    examples = _examples([[2], [3, 4], [], [5]])
    model = AutoModelForImageTextToText.from_pretrained(folders[name], dtype="float32")
    seen: list[dict[str, tuple[int, ...]]] = []
    model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(
        {key: tuple(value.shape) for key, value in kwargs.items() if isinstance(value, torch.Tensor)}),
        with_kwargs=True)
    config = SFTConfig(output_dir=str(folders[name] / "out"), max_steps=1, per_device_train_batch_size=4,
                       use_cpu=True, report_to="none", bf16=False, save_strategy="no", disable_tqdm=True)
    SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(examples),
               processing_class=processor).train()
    keys = [[family.image(image.height, image.width) for image in example["images"]] for example in examples]
    seq = max(len(_planned_ids(processor, family, example)) for example in examples)
    assert seen == [{"input_ids": (4, seq), "attention_mask": (4, seq), "pixel_values": family.pixel_values(keys),
                     **{text: (4, seq) for text in family.TEXT_INPUTS}, **dict(family.inputs(keys)),
                     "labels": (4, seq)}]
