"""Vision-language SFT of the families beyond Qwen-VL (Gemma 3 with and without pan-and-scan, LLaVA-1.5, SmolVLM with
and without image splitting, Idefics3, LLaVA-NeXT) against the real `SFTTrainer` on their tiny random models: every
train and eval batch's (batch, seq), pixel tensor shape and count, as planned."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shapeplan.plan.io import plan_from_dict, plan_to_dict
from shapeplan.services.analyze import analyze
from tests.oracle.vision_data import write_images, write_rows
from tests.oracle.vision_families import write_gemma3, write_llava
from tests.oracle.vision_harness import run_sft_vision
from tests.oracle.vision_tiling import write_llava_next, write_smolvlm

pytestmark = pytest.mark.slow

BUILDERS: dict[str, Callable[[Path], Path]] = {
    "gemma3": write_gemma3,
    "gemma3-pan-and-scan": lambda folder: write_gemma3(folder, pan_and_scan=True),
    "llava": write_llava,
    "smolvlm": write_smolvlm,
    "smolvlm-one-frame": lambda folder: write_smolvlm(folder, splitting=False),
    "idefics3": lambda folder: write_smolvlm(folder, model_type="idefics3"),
    "llava_next": write_llava_next,
}


def _met(shapes: Any) -> Counter[tuple[Any, ...]]:
    """(phase, batch, seq, pixel_values) of every forward (a run's) or shape (a plan's, by its count)."""
    out: Counter[tuple[Any, ...]] = Counter()
    for s in shapes:
        out[(s.phase, s.batch, s.seq, s.pixel_values)] += getattr(s, "count", 1)
    return out


@pytest.mark.parametrize("family", list(BUILDERS))
def test_family_sft_batches_are_planned_exactly(family: str, tmp_path: Path) -> None:
    """Rows of 0, 1 and 2 images of odd sizes, an eval set, padding to 64: the plan's shapes and counts are the
    run's, and its first pixel batch's other tensors are the family's."""
    model = BUILDERS[family](tmp_path / "model")
    images = write_images(tmp_path / "images")
    train = write_rows(tmp_path / "train.jsonl", images, 6, seed=11)
    evaluated = write_rows(tmp_path / "eval.jsonl", images, 3, seed=12)
    argv = ["--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--max_steps", "3",
            "--eval_strategy", "steps", "--eval_steps", "2", "--max_length", "2048", "--pad_to_multiple_of", "64"]
    plan = analyze("sft", ["--dataset_name", str(train), "--model_name_or_path", str(model), *argv],
                   eval_source=str(evaluated), use_cache=False)
    seen = run_sft_vision(train, argv, eval_path=evaluated, model=model)
    assert _met(plan.shapes) == _met(seen)
    assert any(s.pixel_values for s in plan.shapes)
    assert plan.config["vision_family"] == ("smolvlm" if family.startswith("smolvlm") else family.split("-")[0])
    assert plan_from_dict(json.loads(json.dumps(plan_to_dict(plan)))) == plan  # the plan file holds every field
    assert plan.config.get("text_inputs") == (["token_type_ids"] if family.startswith("gemma3") else None)


def _generated(shapes: Any) -> Counter[tuple[Any, ...]]:
    out: Counter[tuple[Any, ...]] = Counter()
    for s in shapes:
        out[(s.phase, s.batch, s.seq, s.cache_len, s.pixel_values)] += getattr(s, "count", 1)
    return out


@pytest.mark.parametrize("method", ["grpo", "rloo"])
@pytest.mark.parametrize("family", ["gemma3", "llava"])
def test_family_generation_runs_are_planned_exactly(family: str, method: str, tmp_path: Path) -> None:
    """GRPO and RLOO on prompts with 0 to 2 images, for the families with one pixel shape per image (the slices TRL
    cuts per chunk by image count): each generate's and forward's (batch, seq, cache, pixel_values) and count."""
    from shapeplan import ShapeGuard
    from tests.oracle.vision_data import write_prompts
    from tests.oracle.vision_harness import run_generation_vision

    model = BUILDERS[family](tmp_path / "model")
    train = write_prompts(tmp_path / "train.jsonl", write_images(tmp_path / "images"), 8, seed=10)
    argv = ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8",
            "--max_steps", "3", "--pad_to_multiple_of", "128", "--cache_implementation", "static", "--beta", "0.04"]
    plan = analyze(method, ["--dataset_name", str(train), "--model_name_or_path", str(model), *argv], use_cache=False)
    guard = ShapeGuard(plan, on_unplanned="record")
    assert _generated(plan.shapes) == _generated(run_generation_vision(method, train, argv, guard=guard, model=model))
    assert not guard.unplanned


def _applied(family: str, model: Path, data: Path, option: Any, tmp_path: Path) -> tuple[Path, Path]:
    """The model folder and data with `option`'s setting applied as its line says."""
    import shutil

    if option.setting.sizes:
        import datasets

        from shapeplan import resize_images

        resized = tmp_path / "resized"
        resize_images(datasets.load_dataset("json", data_files=str(data), split="train"),
                      option.setting.sizes).save_to_disk(str(resized))
        return model, resized
    changed = tmp_path / "changed"
    shutil.copytree(model, changed)
    name, key = (("tokenizer_config.json", "do_pan_and_scan") if family.startswith("gemma3")
                 else ("preprocessor_config.json", "do_image_splitting"))
    assert key in option.setting.apply and name in option.setting.apply
    settings = json.loads((changed / name).read_text())
    (changed / name).write_text(json.dumps({**settings, key: False}))
    return changed, data


@pytest.mark.parametrize("family", ["gemma3-pan-and-scan", "smolvlm", "llava_next"])
def test_each_family_setting_advised_plans_as_its_what_if(family: str, tmp_path: Path) -> None:
    """advise offers the family's setting that fixes its vision graphs (pan-and-scan off, one frame per image,
    images resized to the pinpoints); applied as its line says, the run plans as the what-if did, its images of fewer
    keys, and the real run meets exactly that plan."""
    from shapeplan.services.advise import advise
    from shapeplan.services.vision_advice import VisionAdvice

    model = BUILDERS[family](tmp_path / "model")
    data = write_rows(tmp_path / "train.jsonl", write_images(tmp_path / "images"), 16, seed=11)
    argv = ["--per_device_train_batch_size", "2", "--max_steps", "8", "--max_length", "2048",
            "--pad_to_multiple_of", "64"]
    advice = advise("sft", ["--dataset_name", str(data), "--model_name_or_path", str(model), *argv], use_cache=False)
    assert isinstance(advice, VisionAdvice) and len(advice.options) == 1
    option = advice.options[0]
    keys = [{key for s in plan.shapes for key in s.images} for plan in (advice.baseline.plan, option.plan)]
    assert len(keys[1]) < len(keys[0]) and option.plan.vision_graphs <= advice.baseline.plan.vision_graphs
    assert 0 < option.pixels_kept <= 1
    changed, resized = _applied(family, model, data, option, tmp_path)
    replanned = analyze("sft", ["--dataset_name", str(resized), "--model_name_or_path", str(changed), *argv],
                        use_cache=False)
    assert _met(replanned.shapes) == _met(option.plan.shapes)
    assert _met(run_sft_vision(resized, argv, model=changed)) == _met(option.plan.shapes)
