"""Vision-language SFT of the families beyond Qwen-VL (Gemma 3 with and without pan-and-scan, LLaVA-1.5, SmolVLM with
and without image splitting, Idefics3, LLaVA-NeXT) against the real `SFTTrainer` on their tiny random models: every
train and eval batch's (batch, seq), pixel tensor shape and count, as planned."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

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
