"""The tiling families' image arithmetic equals transformers' own: SmolVLM / Idefics3 (splitting on and off) and
LLaVA-NeXT. Each image's key against the image processor and the model's unpadding, each batch's tokens (the real
tokenizer's ids) and tensors against the processor as TRL's collator calls it, each key's picture against its key,
and one SFTTrainer step per family whose batches have the planned shapes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from shapeplan.plan.vision.idefics3 import Idefics3Images
from shapeplan.plan.vision.llava_next import LlavaNextImages
from tests.oracle.vision_tiling import processor, write_llava_next, write_smolvlm

Size = tuple[int, int]
# (height, width): tiny, odd, tall, wide, about one tile, large, and past SmolVLM's 4096 cap after resizing
SIZES: list[Size] = [(1, 1), (7, 5), (30, 50), (200, 13), (13, 200), (31, 32), (32, 32), (33, 33), (64, 65),
                     (100, 37), (37, 100), (127, 128), (129, 300), (500, 499), (1000, 40), (40, 1000), (3000, 2000),
                     (97, 4500)]
BATCHES: list[list[list[Size]]] = [
    [[(30, 50)], [], [(200, 13), (500, 499)]],
    [[(7, 5), (3000, 2000)], [(33, 33)]],
    [[(1000, 40)], [(40, 1000)], [(127, 128)]],
    [[(1, 1), (64, 65), (13, 200)], [(37, 100)]],
]


def _picture(size: Size) -> Any:
    from PIL import Image

    return Image.new("RGB", (size[1], size[0]), (200, 30, 30))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiling")
    return {"smolvlm": write_smolvlm(root / "smolvlm"), "idefics3": write_smolvlm(root / "idefics3",
                                                                                 model_type="idefics3"),
            "llava_next": write_llava_next(root / "llava_next")}


@pytest.fixture(scope="module")
def processors(folders: dict[str, Path]) -> dict[str, Any]:
    """Each family's processor; `smolvlm-whole`: SmolVLM's with do_image_splitting off."""
    loaded = {name: processor(folder) for name, folder in folders.items()}
    loaded["smolvlm-whole"] = processor(folders["smolvlm"])
    loaded["smolvlm-whole"].image_processor.do_image_splitting = False
    return loaded


def _family(loaded: Any) -> Idefics3Images | LlavaNextImages:
    if hasattr(loaded.image_processor, "image_grid_pinpoints"):
        return LlavaNextImages.from_processor(loaded)
    return Idefics3Images.from_processor(loaded)


@pytest.mark.parametrize("name", ["smolvlm", "smolvlm-whole", "idefics3"])
def test_idefics3_keys_equal_the_image_processor(processors: dict[str, Any], name: str) -> None:
    """Each size's (rows, cols) and frames: the image processor's row/col info and pixel_values."""
    loaded = processors[name]
    family = _family(loaded)
    for size in SIZES:
        out = loaded.image_processor([[_picture(size)]], return_row_col_info=True, return_tensors="np")
        key = family.image(*size)
        assert key == (out["rows"][0][0], out["cols"][0][0]), size
        assert family.pixel_values([[key]]) == out["pixel_values"].shape, size
    assert isinstance(family, Idefics3Images) and family.splitting == (name != "smolvlm-whole")


def test_llava_next_keys_equal_the_processor_and_the_model(processors: dict[str, Any]) -> None:
    """Each size's pinpoint, patches (the image processor's), unpadded grid (the processor's count and the model's
    `unpad_image`); and images of one key run the same `unpad_image` calls, its slice on the rows where the key says
    wide, on the columns where not."""
    import torch
    from torch.overrides import TorchFunctionMode
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_next.modeling_llava_next import unpad_image

    class Calls(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, str]] = []
            self.indices: list[Any] = []

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.calls.append((getattr(func, "__name__", repr(func)), repr(args[1:])))
            if self.calls[-1][0] == "__getitem__":
                self.indices.append(args[1])
            return func(*args, **(kwargs or {}))

    loaded = processors["llava_next"]
    family = _family(loaded)
    assert isinstance(family, LlavaNextImages)
    pinpoints = loaded.image_processor.image_grid_pinpoints
    dispatched: dict[tuple[int, ...], list[tuple[str, str]]] = {}
    sizes = [*SIZES, *itertools.product(range(1, 200, 7), range(1, 200, 11))]
    for size in sizes:
        key = family.image(*size)
        best_h, best_w, rows, cols, wide = key
        assert (best_h, best_w) == select_best_resolution(size, pinpoints), size
        if size in SIZES:
            out = loaded.image_processor([_picture(size)], return_tensors="np")
            assert family.pixel_values([[key]]) == out["pixel_values"].shape, size
        grid = (best_h // family.patch_size, best_w // family.patch_size)
        assert loaded._get_unpadded_features(*size, *grid, 1, 1) == (rows * cols, rows), size
        with Calls() as seen:
            assert unpad_image(torch.zeros(1, *grid), torch.tensor(size)).shape[1:] == (rows, cols), size
        assert dispatched.setdefault(key, seen.calls) == seen.calls, (size, key)
        (index,) = seen.indices  # (all, rows, all) or (all, all, cols)
        assert (index[1] != slice(None)) == bool(wide), (size, key)
    assert len(dispatched) < len(sizes) / 10  # the keys are few: the sizes share them


def _collate(loaded: Any, batch: Sequence[Sequence[Size]]) -> Any:
    """The batch as TRL 1.16's `_collate_language_modeling` processes conversational rows."""
    from trl.data_utils import prepare_multimodal_messages

    messages = [prepare_multimodal_messages(_messages(i), images=[_picture(s) for s in row])
                for i, row in enumerate(batch)]
    return loaded.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs={"padding": True, "padding_side": "right", "pad_to_multiple_of": None,
                          "truncation": False, "max_length": None, "add_special_tokens": False})


def _messages(row: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "what is" + " in the picture" * row + "?"},
            {"role": "assistant", "content": "a red" + " square" * (3 - row)}]


@pytest.mark.parametrize("name", ["smolvlm", "smolvlm-whole", "idefics3", "llava_next"])
def test_batches_equal_the_processor(processors: dict[str, Any], name: str) -> None:
    """For batches of 2-3 rows of 0-3 images: each row's ids are its template text tokenized with each image
    placeholder replaced by the family's expansion of the image's key (so its length is the planned one), and
    pixel_values and every other tensor the images add have the family's shapes."""
    from trl.data_utils import prepare_multimodal_messages

    loaded = processors[name]
    family = _family(loaded)
    for batch in BATCHES:
        out = _collate(loaded, batch)
        keys = [[family.image(*size) for size in row] for row in batch]
        for i, row in enumerate(keys):
            text = loaded.apply_chat_template(prepare_multimodal_messages(_messages(i), images=[None] * len(row)),
                                              tokenize=False)
            pieces = text.split(loaded.image_token)
            assert len(pieces) == len(row) + 1
            expanded = pieces[0] + "".join(family.expansion(key, loaded) + piece
                                           for key, piece in zip(row, pieces[1:], strict=True))
            ids = loaded.tokenizer(expanded, add_special_tokens=False)["input_ids"]
            assert out["input_ids"][i][:int(out["attention_mask"][i].sum())].tolist() == ids, (name, batch, i)
        assert tuple(out["pixel_values"].shape) == family.pixel_values(keys), (name, batch)
        others = {k: tuple(v.shape) for k, v in out.items() if k not in ("input_ids", "attention_mask",
                                                                         "pixel_values")}
        assert others == dict(family.inputs(keys)), (name, batch)
    empty = _collate(loaded, [[], []])
    assert family.pixel_values([[], []]) == () and "pixel_values" not in empty
    assert family.inputs([[], []]) == ()


def _keys(family: Idefics3Images | LlavaNextImages) -> set[tuple[int, ...]]:
    sides = sorted({*range(1, 80, 3), *range(80, 1200, 23), 1456, 2000, 4096, 6000})
    return {family.image(h, w) for h, w in itertools.product(sides, sides)}


FAMILIES: dict[str, Callable[[], Idefics3Images | LlavaNextImages]] = {
    "smolvlm-tiny": lambda: Idefics3Images(tile=32, longest_edge=128),
    "smolvlm-checkpoint": lambda: Idefics3Images(tile=364, longest_edge=1456),  # SmolVLM's class defaults
    "smolvlm2-256m": lambda: Idefics3Images(tile=512, longest_edge=2048),
    "idefics3-unresized": lambda: Idefics3Images(tile=32, longest_edge=None),
    "smolvlm-whole": lambda: Idefics3Images(tile=364, longest_edge=1456, splitting=False),
    "llava-next-tiny": lambda: LlavaNextImages(pinpoints=((32, 64), (64, 32), (64, 64), (96, 32), (32, 96)),
                                               frame=32, patch_size=8),
    "llava-next-checkpoint": lambda: LlavaNextImages(  # llava-v1.6-*-hf
        pinpoints=((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)), frame=336, patch_size=14),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_key_has_a_picture_of_that_key(name: str) -> None:
    """`picture(key)` is a size the processor maps to that key (the processor's map is `image`, proven above),
    for every key of a dense spread of sizes; a key no size has is refused."""
    family = FAMILIES[name]()
    keys = _keys(family)
    for key in keys:
        assert family.image(*family.picture(key)) == key, (name, key)
    if isinstance(family, Idefics3Images):
        if not family.splitting:
            assert keys == {(0, 0)}
        elif family.longest_edge:  # every image's long side is ceil(longest_edge / tile) tiles: 2n - 1 keys
            n = -(-family.longest_edge // family.tile)
            assert keys == {(n, k) for k in range(1, n + 1)} | {(k, n) for k in range(1, n + 1)}, keys
        with pytest.raises(ValueError, match="no image"):
            family.picture((9, 9) if family.longest_edge else (0, 5))
    else:
        assert {family.patches(key) for key in keys} <= {1 + h * w // family.frame ** 2 for h, w in family.pinpoints}
        with pytest.raises(ValueError, match="no image"):
            family.picture((*family.pinpoints[0], 1, 1, 1))


def test_settings_the_arithmetic_cannot_use_are_refused(processors: dict[str, Any]) -> None:
    """...and the processor's call kwargs override its image processor's settings, as at call."""
    import copy

    assert not Idefics3Images.from_image_processor(processors["smolvlm"].image_processor,
                                                   {"do_image_splitting": False}).splitting
    smol = copy.deepcopy(processors["smolvlm"].image_processor)
    smol.do_pad = False
    with pytest.raises(ValueError, match="do_pad"):
        Idefics3Images.from_image_processor(smol)
    smol = copy.deepcopy(processors["smolvlm"].image_processor)
    smol.max_image_size = {"longest_edge": 0}
    with pytest.raises(ValueError, match="max_image_size"):
        Idefics3Images.from_image_processor(smol)
    loaded = processors["llava_next"]
    with pytest.raises(ValueError, match="patch_size"):
        LlavaNextImages.from_image_processor(loaded.image_processor)
    with pytest.raises(ValueError, match="patch_size"):
        LlavaNextImages.from_image_processor(loaded.image_processor, patch_size=5)
    odd = copy.deepcopy(loaded.image_processor)
    odd.image_grid_pinpoints = [[32, 48]]
    with pytest.raises(ValueError, match="image_grid_pinpoints"):
        LlavaNextImages.from_image_processor(odd, patch_size=8)


@pytest.mark.parametrize("name", ["smolvlm", "llava_next"])
def test_one_sft_step_feeds_the_planned_shapes(folders: dict[str, Path], processors: dict[str, Any], name: str,
                                               tmp_path: Path) -> None:
    """TRL 1.16's SFTTrainer trains a step on the tiny model with a 4-row messages+images dataset, and the model
    receives the tensors the family plans for each batch of 2 rows."""
    import datasets
    import torch
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig, SFTTrainer

    rows = [[(30, 50)], [(200, 13), (64, 65)], [(1, 1)], [(40, 1000), (3000, 2000)]]
    data = datasets.Dataset.from_dict({"messages": [_messages(i % 3) for i in range(4)],
                                       "images": [[_picture(s) for s in row] for row in rows]})
    model = AutoModelForImageTextToText.from_pretrained(folders[name], dtype="float32")
    seen: list[dict[str, tuple[int, ...]]] = []
    model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(
        {k: tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}), with_kwargs=True)
    config = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to="none",
                       use_cpu=True, save_strategy="no", bf16=False, disable_tqdm=True,
                       train_sampling_strategy="sequential")
    SFTTrainer(model=model, args=config, train_dataset=data, processing_class=processors[name]).train()
    assert len(seen) == 2
    family = _family(processors[name])
    for step, shapes in enumerate(seen):
        keys = [[family.image(*s) for s in rows[i]] for i in (2 * step, 2 * step + 1)]
        assert shapes["pixel_values"] == family.pixel_values(keys)
        assert {k: v for k, v in shapes.items() if k not in ("input_ids", "attention_mask", "labels",
                                                             "pixel_values")} == dict(family.inputs(keys))
