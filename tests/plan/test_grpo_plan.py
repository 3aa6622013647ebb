"""GRPO and RLOO planning around the oracle: completion buckets, the guide's example, cache pinning advice, the
report and plan file, multi-process generation batches, and one-line errors through the CLI."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from shapeplan.cli import main
from shapeplan.plan.grpo import GenerationLayout, ToolLoop, cache_pin, completion_buckets, plan_generation
from shapeplan.plan.io import dumps, plan_from_dict
from shapeplan.plan.model import GENERATE_PHASES
from shapeplan.plan.schedule import TrainLoop
from shapeplan.services.analyze import analyze
from shapeplan.services.trainers import TRAINERS
from tests.conftest import CAPYBARA, TINY_MODEL, TLDR

RUN = ["--dataset_name", str(TLDR), "--model_name_or_path", str(TINY_MODEL)]


def test_completion_buckets() -> None:
    assert completion_buckets(128, 128) == (128,)
    assert completion_buckets(32, 128) == (128,)
    assert completion_buckets(200, 128) == (128, 256)
    assert completion_buckets(512, 128) == (128, 256, 384, 512)
    assert completion_buckets(4, None) == (1, 2, 3, 4)


def test_tool_turns_are_a_bound_of_buckets_batches_and_cache_lengths() -> None:
    """The tool loop's bound, as a pure function of the prompt lengths: turn prompts from the shortest prompt plus
    one turn's growth to the longest plus max_completion_length; any batch from 1 to the round's rows; each cache
    length the running maximum can reach. The first generate stays certain until a tool turn may have grown the
    cache; a certain entry that a tool turn may also meet keeps its certain count and says its most."""
    loop = ToolLoop(turns=2, min_growth=20, max_completion_length=200)
    assert loop.buckets([100, 120], 128) == (128, 256, 384)
    assert loop.buckets([100, 120], None) == tuple(range(120, 321))
    assert ToolLoop(turns=1, min_growth=20, max_completion_length=10).buckets([100], 128) == ()

    def layout(tool_loop: ToolLoop | None, pinned: int | None = None) -> GenerationLayout:
        return GenerationLayout(batch_size=2, steps_per_generation=1, num_iterations=1, pad_to_multiple_of=128,
                                max_new_tokens=64, static_cache=True, max_cache_len=pinned, round_forwards=(),
                                eval_batch_size=2, eval_forwards=(), tool_loop=tool_loop)

    loop = ToolLoop(turns=2, min_growth=20, max_completion_length=64)
    lengths, batches = [100, 100, 180, 180], lambda epoch: (((0, 1), (2, 3)),)  # one rank, two rounds
    trainer_loop = TrainLoop(steps_in_epoch=2, gradient_accumulation_steps=1, max_steps=2, num_train_epochs=1)

    def plan(layout: GenerationLayout) -> dict[tuple[int, int, int | None], tuple[int, int | None, bool]]:
        shapes = plan_generation(method="grpo", prompt_lengths=lengths, layout=layout, loop=trainer_loop,
                                 epoch_batches=batches).by_phase("generate")
        return {(s.batch, s.seq, s.cache_len): (s.count, s.max_count, s.certain) for s in shapes}

    assert plan(layout(None)) == {(2, 128, 191): (1, None, True), (2, 256, 319): (1, None, True)}
    # round 1 (prompts of 100: turns at 128, only the first, 100 + 2 x 20 being past it, or 256); round 2 (180:
    # turns at 256), its first generate at 319 whatever came before, since a turn of round 1 reaches at most 319 too
    assert plan(layout(loop)) == {
        (1, 128, 191): (1, None, False), (2, 128, 191): (1, 2, True),
        (1, 256, 319): (4, None, False), (2, 256, 319): (1, 5, True)}
    # pinned past every turn: one cache length
    assert {key[2] for key in plan(layout(loop, pinned=400))} == {400}
    # unpadded, the plan says what padding the turns saves; padded, every turn is on the round's rows
    warned = [w for w in plan_generation(method="grpo", prompt_lengths=lengths, layout=layout(loop), loop=trainer_loop,
                                         epoch_batches=batches).warnings if w.startswith("tool turns")]
    assert warned and "4 generate entries where about 2 would do padded" in warned[0]
    padded = plan_generation(method="grpo", prompt_lengths=lengths, loop=trainer_loop, epoch_batches=batches,
                             layout=layout(dataclasses.replace(loop, padded=True)))
    assert {s.batch for s in padded.by_phase("generate")} == {2}
    assert not [w for w in padded.warnings if w.startswith("tool turns")]
    assert [w for w in padded.warnings if w.startswith("the plan is of a run with its tool turns padded")]
    # pinned at the longest any call needs (--pin_cache, the default with tools): every call at 319, round 1's first
    # generate (which needs 191) too, so the plan records the pin; a turn's count is the turns that can meet it
    pinned = plan_generation(method="grpo", prompt_lengths=lengths, loop=trainer_loop, epoch_batches=batches,
                             layout=dataclasses.replace(layout(loop), pin_cache=True))
    assert {(s.batch, s.seq, s.cache_len): (s.count, s.max_count, s.certain) for s in pinned.by_phase("generate")} \
        == {(1, 128, 319): (1, None, False), (2, 128, 319): (1, 2, True),
            (1, 256, 319): (4, None, False), (2, 256, 319): (1, 5, True)}
    assert pinned.config["pin_cache"] == 319 and [w for w in pinned.warnings if "static cache pinned at 319" in w]
    # a run whose first call already needs the longest length meets no other, pinned or not: nothing to record
    first_longest = plan_generation(method="grpo", prompt_lengths=lengths[::-1], loop=trainer_loop,
                                    epoch_batches=batches, layout=dataclasses.replace(layout(loop), pin_cache=True))
    assert {s.cache_len for s in first_longest.by_phase("generate")} == {319}
    assert "pin_cache" not in first_longest.config


def test_no_training_option_plans_the_guide_example() -> None:
    guide = analyze("grpo", RUN)
    explicit = analyze("grpo", [*RUN, *TRAINERS["grpo"].guide_options])
    assert guide.shapes == explicit.shapes
    assert "Trainium guide" in guide.warnings[0]
    assert {s.batch for s in guide.by_phase("generate")} == {4}


def test_any_training_option_keeps_trl_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    plan = analyze("grpo", [*RUN, "--max_steps", "2"])
    assert (plan.config["num_generations"], plan.config["max_completion_length"]) == (8, 512)
    assert {s.cache_len for s in plan.by_phase("generate")} == {None}
    assert any(w.startswith("generation uses a dynamic cache") for w in plan.warnings)
    assert not any("Trainium guide" in w for w in plan.warnings)
    # 512 new tokens at a multiple of 128: four completion buckets, none certain
    assert {s.logits_to_keep for s in plan.by_phase("train")} == {128, 256, 384, 512}
    assert not any(s.certain for s in plan.by_phase("train"))
    assert main(["analyze", "--method", "grpo", str(TLDR), "--model", str(TINY_MODEL), "--max_steps", "2"]) == 0
    sizes = len({s.key for s in plan.by_phase("generate")})
    assert f"generate sizes: {sizes} (batch, prompt bucket) with a dynamic cache: every decode step is a new " \
           "shape, up to 511 per size" in capsys.readouterr().out


def test_pinning_the_advised_cache_length_leaves_one_per_size() -> None:
    growing = analyze("grpo", RUN)
    advice = next(w for w in growing.warnings if "max_cache_len" in w)
    value = re.search(r"--generation_kwargs '(.*)'", advice).group(1)  # type: ignore[union-attr]
    pin = cache_pin(growing.shapes)
    assert pin is not None and json.loads(value) == {"max_cache_len": pin.max_cache_len}

    pinned = analyze("grpo", [*RUN, *TRAINERS["grpo"].guide_options, "--generation_kwargs", value])
    generate = [s for s in pinned.shapes if s.phase in GENERATE_PHASES]
    assert {s.cache_len for s in generate} == {pin.max_cache_len}
    assert len({s.key for s in generate}) == pin.pinned_graphs < pin.graphs
    assert sum(s.count for s in generate) == sum(s.count for s in growing.shapes if s.phase in GENERATE_PHASES)
    assert cache_pin(pinned.shapes) is None and not any("max_cache_len" in w for w in pinned.warnings)


def test_report_prices_generate_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "--method", "grpo", str(TLDR), "--model", str(TINY_MODEL),
                 "--generate-compile-minutes", "5"]) == 0
    out = capsys.readouterr().out
    plan = analyze("grpo", RUN)
    sizes = len({s.key for s in plan.shapes if s.phase in GENERATE_PHASES})
    pin = cache_pin(plan.shapes)
    assert pin is not None
    assert f"generate sizes: {sizes} (batch, prompt bucket, cache length), {sizes * 5} min to compile" in out
    assert f"pinning max_cache_len={pin.max_cache_len} leaves {pin.pinned_graphs} generate sizes and saves " \
           f"{pin.saved * 5} min" in out


def test_compile_minutes_option_is_no_trl_or_accelerate_option() -> None:
    from accelerate.commands.launch import launch_command_parser

    from shapeplan.adapters.trl_args import make_parser

    names = {"--generate-compile-minutes", "--generate_compile_minutes"}
    for method in ("grpo", "rloo"):
        assert not names & set(make_parser(TRAINERS[method])._option_string_actions)
    assert not names & set(launch_command_parser()._option_string_actions)


def test_plan_file_round_trips_generation_fields() -> None:
    plan = analyze("rloo", [*RUN, "--max_steps", "1", "--per_device_train_batch_size", "2",
                            "--max_completion_length", "256", *("--cache_implementation", "static")])
    data = json.loads(dumps(plan))
    assert data["schema"] == 1
    phases = {s["phase"] for s in data["shapes"]}
    assert phases == {"generate", "old_logprob", "ref", "train"}
    generate = [s for s in data["shapes"] if s["phase"] == "generate"]
    assert all(s["max_new_tokens"] == 256 and s["cache_len"] == s["seq"] + 255 for s in generate)
    assert all(s["certain"] is False and s["logits_to_keep"] in (128, 256)
               for s in data["shapes"] if s["phase"] != "generate")
    assert plan_from_dict(data) == plan


def test_generation_batch_follows_num_processes() -> None:
    # GRPOConfig sizes the generation batch with the process count: 2 x 2 rows hold one group of 4 generations,
    # which a single process could not.
    plan = analyze("grpo", [*RUN, "--per_device_train_batch_size", "2", "--num_generations", "4",
                            "--max_steps", "1", "--num_processes", "2", "--max_completion_length", "8"])
    assert plan.config["generation_batch_size"] == 4
    assert {s.batch for s in plan.by_phase("generate")} == {2}
    assert sum(s.count for s in plan.by_phase("generate")) == 2  # one round per rank

    plan = analyze("grpo", [*RUN, "--per_device_train_batch_size", "2", "--generation_batch_size", "8",
                            "--num_generations", "4", "--max_steps", "2", "--num_processes", "2",
                            "--max_completion_length", "8"])
    assert (plan.config["steps_per_generation"], plan.config["generation_batch_size"]) == (2, 8)
    assert {s.batch for s in plan.by_phase("generate")} == {4}
    assert sum(s.count for s in plan.by_phase("generate")) == 2  # one round per rank
    assert sum(s.count for s in plan.by_phase("train")) == 4  # two ranks x two micro-steps


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], code: int) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    # datasets may print its progress bar first; the error itself is one line, no traceback
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in err and err.rstrip().endswith(errors[0])
    return errors[0]


def test_dataset_without_prompt_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(capsys, ["analyze", "--method", "grpo", str(CAPYBARA), "--model", str(TINY_MODEL)], 1)
    assert "no 'prompt' column" in err and "messages" in err


def test_generation_batch_not_divisible_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(capsys, ["analyze", "--method", "grpo", str(TLDR), "--model", str(TINY_MODEL),
                                   "--per_device_train_batch_size", "3", "--num_generations", "4"], 2)
    assert "divisible by num_generations" in err


def test_vllm_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(capsys, ["analyze", "--method", "rloo", str(TLDR), "--model", str(TINY_MODEL),
                                   "--use_vllm"], 2)
    assert "vLLM does not run on Neuron" in err


def test_reward_model_is_planned_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "--method", "grpo", str(TLDR), "--model", str(TINY_MODEL), "--json",
                 "--reward_model_name_or_path", "my-org/reward", "--max_steps", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert any(w.startswith("reward model my-org/reward is not planned") for w in plan["warnings"])
    assert {s["phase"] for s in plan["shapes"]} == {"generate", "train"}


def test_fewer_prompts_than_a_generation_batch_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # 130 rows per device / 2 generations = 65 unique prompts per round; the sample has 64
    err = _one_line_error(capsys, ["analyze", "--method", "grpo", str(TLDR), "--model", str(TINY_MODEL),
                                   "--per_device_train_batch_size", "130", "--num_generations", "2"], 1)
    assert "64 prompts, fewer than one generation batch holds (65 unique prompts)" in err
