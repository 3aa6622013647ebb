"""Vision-language SFT against the real `SFTTrainer` with the tiny Qwen2.5-VL: every train and eval batch, its
pixel rows and its image grids included, as planned."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shapeplan import ShapeGuard
from shapeplan.services.analyze import analyze
from tests.conftest import TINY_VL_MODEL
from tests.oracle.vision_data import (
    write_images,
    write_prompts,
    write_qwen2_vl,
    write_qwen3_vl,
    write_rows,
    write_structured_rows,
)
from tests.oracle.vision_harness import observed, planned, run_generation_vision, run_sft_vision

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_images(tmp_path_factory.mktemp("images"))


def _other_processor(tmp_path: Path) -> Path:
    """The tiny model with another processor: min/max pixels given as `min_pixels`/`max_pixels` keys, and its own
    chat template in a legacy `chat_template.json` (another default system turn than the tokenizer's)."""
    model = tmp_path / "model"
    shutil.copytree(TINY_VL_MODEL, model)
    config = json.loads((model / "preprocessor_config.json").read_text())
    config.pop("size")
    config.update(min_pixels=12544, max_pixels=50176)
    (model / "preprocessor_config.json").write_text(json.dumps(config))
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").unlink()
    (model / "chat_template.json").write_text(json.dumps({"chat_template": template.replace(
        "You are a helpful assistant.", "You describe images in great detail, one red square at a time.")}))
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": template}))
    return model


@pytest.mark.parametrize("kind", ["prompt-completion", "prompt-completion-text"])
def test_vision_prompt_completion_batches_are_planned_exactly(kind: str, images: list[str], tmp_path: Path) -> None:
    """Prompt-completion rows (prompt and completion tokenized apart, joined by `flush_left`), unpadded as TRL's
    vision collator requires; a max_length that cuts some rows' completions."""
    train = write_rows(tmp_path / "train.jsonl", images, 8, seed=3, kind=kind)
    argv = ["--per_device_train_batch_size", "2", "--max_steps", "4", "--max_length", "400"]
    plan = analyze("sft", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_VL_MODEL),
                           "--pad_to_multiple_of", "none", *argv], use_cache=False)
    seen = observed(run_sft_vision(train, ["--pad_to_multiple_of", "none", *argv]))
    assert planned(plan) == seen
    assert any(key[4] for key in seen) and any(key[2] == 400 for key in seen)


def test_assistant_only_loss_is_planned_with_the_collator_s_template(images: list[str], tmp_path: Path) -> None:
    """assistant_only_loss: the collator renders with TRL's training variant of the chat template."""
    train = write_rows(tmp_path / "train.jsonl", images, 6, seed=4)
    argv = ["--per_device_train_batch_size", "2", "--max_steps", "3", "--max_length", "640", "--pad_to_multiple_of",
            "128", "--assistant_only_loss", "true"]
    plan = analyze("sft", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_VL_MODEL), *argv],
                   use_cache=False)
    assert planned(plan) == observed(run_sft_vision(train, argv))


@pytest.mark.parametrize("kind", ["messages", "image", "text"])
def test_vision_sft_batches_are_planned_exactly(kind: str, images: list[str], tmp_path: Path) -> None:
    """Rows by path (messages), as `datasets` Image features (image) and as text with the user's placeholders (which
    TRL reads only with remove_unused_columns off), with an eval set; but for `image`, with another processor's
    min/max pixels and chat template; the guard holding the plan finds nothing unplanned."""
    model = _other_processor(tmp_path) if kind != "image" else TINY_VL_MODEL
    train = write_rows(tmp_path / "train.jsonl", images, 9, seed=1, kind=kind)
    evaluation = write_rows(tmp_path / "eval.jsonl", images, 3, seed=2, kind=kind)
    argv = ["--per_device_train_batch_size", "3" if kind == "image" else "2", "--max_steps", "4", "--max_length",
            "640", "--eval_strategy", "steps", "--eval_steps", "3", "--per_device_eval_batch_size", "2",
            *(["--remove_unused_columns", "false"] if kind == "text" else [])]
    plan = analyze("sft", ["--dataset_name", str(train), "--model_name_or_path", str(model),
                           "--pad_to_multiple_of", "128", *argv], eval_source=str(evaluation), use_cache=False)
    guard = ShapeGuard(plan, on_unplanned="record")
    seen = observed(run_sft_vision(train, ["--pad_to_multiple_of", "128", *argv], eval_path=evaluation,
                                   images="image" if kind == "image" else None, model=model, guard=guard))
    assert planned(plan) == seen
    assert not guard.unplanned
    assert any(key[4] for key in seen) and any(key[0] == "eval" for key in seen)


def test_the_guard_names_an_unplanned_pixel_batch(images: list[str], tmp_path: Path,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """A plan without one of the run's pixel batches: the guard reports that batch, its pixel_values included, and
    nothing else."""
    import dataclasses

    train = write_rows(tmp_path / "train.jsonl", images, 6, seed=4)
    argv = ["--per_device_train_batch_size", "2", "--max_steps", "3", "--max_length", "1024"]
    plan = analyze("sft", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_VL_MODEL),
                           "--pad_to_multiple_of", "128", *argv], use_cache=False)
    dropped = next(s for s in plan.shapes if s.pixel_values is not None)
    guard = ShapeGuard(dataclasses.replace(plan, shapes=tuple(s for s in plan.shapes if s != dropped)),
                       on_unplanned="warn")
    run_sft_vision(train, ["--pad_to_multiple_of", "128", *argv], guard=guard)
    assert [f.images for f in guard.unplanned.values()] == [dropped.images]
    lines = [line for line in capfd.readouterr().err.splitlines() if "unplanned shape" in line]
    assert len(lines) == 1 and f"with pixel_values {list(dropped.pixel_values or ())}" in lines[0], lines


def test_the_advised_fixed_sizes_applied_give_the_advised_vision_graphs(images: list[str], tmp_path: Path) -> None:
    """advise's fewest-compiles fixed sizes, applied with `resize_images` (a `datasets.map`): the resized dataset
    plans as the what-if did, and the real run meets exactly its shapes, as many vision graphs as advised. Its pixel
    limits what-if, set in a copy of the processor's config, plans and runs as the what-if did too."""
    import datasets

    from shapeplan import resize_images
    from shapeplan.services.advise import advise
    from shapeplan.services.vision_advice import VisionAdvice

    train = write_rows(tmp_path / "train.jsonl", images, 12, seed=5)
    argv = ["--per_device_train_batch_size", "2", "--max_length", "1024", "--pad_to_multiple_of", "128"]
    advice = advise("sft", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_VL_MODEL), *argv],
                    use_cache=False)
    assert isinstance(advice, VisionAdvice)
    best = next(option for option in advice.options if option.setting.sizes)  # the options: fewest first
    assert best.plan.vision_graphs < advice.baseline.plan.vision_graphs
    resized = tmp_path / "resized"
    data = datasets.load_dataset("json", data_files=str(train), split="train")
    resize_images(data, best.setting.sizes).save_to_disk(str(resized))
    replanned = analyze("sft", ["--dataset_name", str(resized), "--model_name_or_path", str(TINY_VL_MODEL), *argv],
                        use_cache=False)
    assert planned(replanned) == planned(best.plan)
    seen = observed(run_sft_vision(resized, argv))
    assert seen == planned(best.plan)
    assert len({key[4] for key in seen if key[4]}) == best.plan.vision_graphs

    limited = next(option for option in advice.options if option.setting.pixel_limits is not None)
    low, high = limited.setting.pixel_limits
    model = tmp_path / "limited"
    shutil.copytree(TINY_VL_MODEL, model)
    config = json.loads((model / "preprocessor_config.json").read_text())
    config["size"] = {"shortest_edge": low, "longest_edge": high}
    (model / "preprocessor_config.json").write_text(json.dumps(config))
    assert f'"size": {{"shortest_edge": {low}, "longest_edge": {high}}}' in limited.setting.apply
    replanned = analyze("sft", ["--dataset_name", str(train), "--model_name_or_path", str(model), *argv],
                        use_cache=False)
    assert planned(replanned) == planned(limited.plan)
    assert observed(run_sft_vision(train, argv, model=model)) == planned(limited.plan)


def test_qwen2_vl_with_structured_turns_is_planned_exactly(images: list[str], tmp_path: Path) -> None:
    """A Qwen2-VL (its own processor class and pixel limits) on rows of typed content parts with a system turn
    and the images in a later user turn, at batch 3."""
    model = write_qwen2_vl(tmp_path / "qwen2-vl", TINY_VL_MODEL)
    train = write_structured_rows(tmp_path / "train.jsonl", images, 10, seed=7)
    argv = ["--per_device_train_batch_size", "3", "--max_steps", "3", "--max_length", "768", "--pad_to_multiple_of",
            "128"]
    plan = analyze("sft", ["--dataset_name", str(train), "--model_name_or_path", str(model), *argv], use_cache=False)
    assert planned(plan) == observed(run_sft_vision(train, argv, model=model))


def test_qwen3_vl_is_planned_exactly(images: list[str], tmp_path: Path) -> None:
    """A Qwen3-VL: its own processor class, 16-pixel patches (1536-wide patch rows), other pixel limits."""
    model = write_qwen3_vl(tmp_path / "qwen3-vl", TINY_VL_MODEL)
    train = write_rows(tmp_path / "train.jsonl", images, 8, seed=5)
    argv = ["--per_device_train_batch_size", "2", "--max_steps", "4", "--max_length", "640", "--pad_to_multiple_of",
            "128"]
    plan = analyze("sft", ["--dataset_name", str(train), "--model_name_or_path", str(model), *argv], use_cache=False)
    seen = observed(run_sft_vision(train, argv, model=model))
    assert planned(plan) == seen
    assert all(pixels[1] == 1536 for _, _, pixels in seen.values() if pixels)


def test_a_streamed_vision_run_is_planned_exactly(images: list[str], tmp_path: Path) -> None:
    """--dataset_streaming: SFTTrainer neither prepares nor shuffles a vision stream, so batches are its rows in
    stream order; a stream of 5 rows is read again until max_steps; the eval stream read whole."""
    train = write_rows(tmp_path / "train.jsonl", images, 5, seed=8)
    evaluation = write_rows(tmp_path / "eval.jsonl", images, 3, seed=9)
    argv = ["--per_device_train_batch_size", "2", "--max_steps", "4", "--max_length", "640", "--pad_to_multiple_of",
            "128", "--eval_strategy", "steps", "--eval_steps", "4", "--per_device_eval_batch_size", "2"]
    plan = analyze("sft", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_VL_MODEL),
                           "--dataset_streaming", *argv], eval_source=str(evaluation), use_cache=False)
    seen = observed(run_sft_vision(train, argv, eval_path=evaluation, streaming=True))
    assert planned(plan) == seen
    assert any(key[0] == "eval" for key in seen)


def test_vision_grpo_with_gradient_accumulation_stays_inside_its_bound(images: list[str], tmp_path: Path) -> None:
    """GRPO with gradient accumulation 2 on rounds of several prompts: the trainer shuffles each round's rows before
    cutting its two micro-batches, so a train forward's images are any of the round's; every shape the run meets is
    planned, each certain one as often as planned, no possible one more often than its bound."""
    train = write_prompts(tmp_path / "train.jsonl", images, 12, seed=10)
    argv = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--num_generations", "2",
            "--max_completion_length", "8", "--max_steps", "3", "--pad_to_multiple_of", "128",
            "--cache_implementation", "static"]
    plan = analyze("grpo", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_VL_MODEL), *argv],
                   use_cache=False)
    guard = ShapeGuard(plan, on_unplanned="record")
    seen = observed(run_generation_vision("grpo", train, argv, guard=guard))
    assert not guard.unplanned
    bounds = {key: s for key, s in zip(planned(plan), plan.shapes, strict=True)}
    for key, (count, _, _) in seen.items():
        shape = bounds[key]
        most = shape.max_count or shape.count
        assert count == shape.count if shape.certain and shape.max_count is None else count <= most, (key, count)
    assert any(not s.certain for s in plan.shapes if s.phase == "train")


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_vision_generation_runs_are_planned_exactly(method: str, images: list[str], tmp_path: Path) -> None:
    """GRPO and RLOO on prompts with images, two prompts a round: each generate carries its rows' image encode, each
    no-grad forward its rows' pixel batch, each train forward its shuffled round's (grids keyed in sorted order); an
    eval loop of two prompts a batch."""
    train = write_prompts(tmp_path / "train.jsonl", images, 8, seed=10)
    evaluation = write_prompts(tmp_path / "eval.jsonl", images, 4, seed=11)
    argv = ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8",
            "--max_steps", "3", "--pad_to_multiple_of", "128", "--cache_implementation", "static", "--beta", "0.04",
            "--eval_strategy", "steps", "--eval_steps", "3", "--per_device_eval_batch_size", "4"]
    plan = analyze(method, ["--dataset_name", str(train), "--model_name_or_path", str(TINY_VL_MODEL), *argv],
                   eval_source=str(evaluation), use_cache=False)
    guard = ShapeGuard(plan, on_unplanned="record")
    seen = observed(run_generation_vision(method, train, argv, eval_path=evaluation, guard=guard))
    assert planned(plan) == seen
    assert not guard.unplanned
    assert {key[0] for key in seen if key[4]} >= {"generate", "ref", "train", "eval_generate", "eval"}


def test_grpo_with_the_advised_fixed_size_applied_meets_the_advised_vision_graphs(images: list[str],
                                                                                  tmp_path: Path) -> None:
    """advise on a GRPO run weighs its prompts' images; its one-size what-if, applied with `resize_images`, plans
    as the what-if did and the real GRPOTrainer run meets exactly its shapes."""
    import datasets

    from shapeplan import resize_images
    from shapeplan.services.advise import advise
    from shapeplan.services.vision_advice import VisionAdvice

    train = write_prompts(tmp_path / "train.jsonl", images, 6, seed=12)
    argv = ["--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "8",
            "--max_steps", "3", "--pad_to_multiple_of", "128", "--cache_implementation", "static"]
    advice = advise("grpo", ["--dataset_name", str(train), "--model_name_or_path", str(TINY_VL_MODEL), *argv],
                    use_cache=False)
    assert isinstance(advice, VisionAdvice)
    one = next(option for option in advice.options if len(option.setting.sizes) == 1)
    assert one.plan.vision_graphs < advice.baseline.plan.vision_graphs
    resized = tmp_path / "resized"
    resize_images(datasets.load_dataset("json", data_files=str(train), split="train"),
                  one.setting.sizes).save_to_disk(str(resized))
    replanned = analyze("grpo", ["--dataset_name", str(resized), "--model_name_or_path", str(TINY_VL_MODEL), *argv],
                        use_cache=False)
    assert planned(replanned) == planned(one.plan)
    assert observed(run_generation_vision("grpo", resized, argv)) == planned(one.plan)
