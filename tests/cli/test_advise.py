"""`shapeplan advise`: every row is the plan `analyze` makes with that row's flags; the cost model, ranking and
recommendation; the pictures; the guide's caveats; the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from shapeplan.adapters import lengths as lengths_module
from shapeplan.plan.advice import (
    Candidate,
    CostModel,
    DataLoss,
    Measurement,
    Option,
    PlanCost,
    Settings,
    calibrated,
    candidates,
    recommendation,
)
from shapeplan.plan.caveats import caveats
from shapeplan.plan.io import shape_to_dict
from shapeplan.plan.kv_cache import peak_bytes, token_bytes
from shapeplan.plan.model import Plan, PlanStats, Shape
from shapeplan.services.advice_page import render_html
from shapeplan.services.advice_report import (
    WIDTH,
    advice_to_dict,
    histogram,
    render_advice,
)
from shapeplan.services.advise import Advice, advise
from shapeplan.services.analyze import analyze
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL, TLDR

SFT_ARGV = ["--dataset_name", str(CAPYBARA), "--model_name_or_path", str(TINY_MODEL),
            "--per_device_train_batch_size", "4", "--max_length", "1024"]
GRPO_ARGV = ["--dataset_name", str(TLDR), "--model_name_or_path", str(TINY_MODEL)]


def _shapes(plan: Plan) -> list[dict[str, object]]:
    return [shape_to_dict(s, plan.config) for s in plan.shapes]


def _check_every_row(method: str, advice: Advice) -> None:
    """Each row's shapes and stats equal a fresh `analyze` (no length cache, no shared tokenization) run with the
    baseline's options plus the row's flags, as a user would append them."""
    assert advice.options, "no alternative was planned"
    for option in [advice.baseline, *advice.options]:
        flags = option.candidate.argv() if option.candidate is not None else []
        fresh = analyze(method, [*advice.argv, *flags], use_cache=False)
        assert _shapes(option.plan) == _shapes(fresh), option.label
        assert option.plan.stats == fresh.stats, option.label


def test_every_sft_alternative_is_the_plan_analyze_makes_with_its_flags() -> None:
    advice = advise("sft", SFT_ARGV)
    labels = {o.label for o in advice.options}
    assert {"pad_to_multiple_of 64", "pad_to_multiple_of 256", "pad_to_multiple_of 512", "pad_to_multiple_of none",
            "max_length 896", "max_length 128", "bfd packing", "padding_free", "batch 2 x accumulation 2",
            "batch 1 x accumulation 4"} <= labels
    _check_every_row("sft", advice)
    totals = [o.cost.total_s for o in advice.options]
    assert totals == sorted(totals)
    # max_length caps state what they lose, against the untruncated lengths
    cap = next(o for o in advice.options if o.label == "max_length 512")
    assert cap.loss.rows_truncated == sum(1 for n in advice.lengths if 512 < n <= 1024) > 0
    assert cap.loss.tokens_lost == advice.baseline.plan.stats.tokens - cap.plan.stats.tokens > 0
    assert not next(o for o in advice.options if o.label == "pad_to_multiple_of 512").loss.loses_data
    # never recommends a data-losing change without --allow-truncation
    assert advice.recommended is not None and not advice.recommended.loss.loses_data
    assert advice.recommended.cost.total_s == min(o.cost.total_s for o in advice.options if not o.loss.loses_data)


def test_every_grpo_alternative_is_the_plan_analyze_makes_with_its_flags() -> None:
    advice = advise("grpo", GRPO_ARGV)
    labels = {o.label for o in advice.options}
    assert "pin max_cache_len 639" in labels and "pad_to_multiple_of 256" in labels
    # the guide's example options are spelled out, so adding an option does not switch the example off
    assert advice.argv[:2] == ("--per_device_train_batch_size", "4")
    _check_every_row("grpo", advice)
    pinned = next(o for o in advice.options if o.label == "pin max_cache_len 639")
    assert pinned.cost.shapes_per_phase["generate"] == 4 < advice.baseline.cost.shapes_per_phase["generate"]
    # what the pin costs in memory: every call at 639, so the largest batch holds a cache that long; a token holds a
    # key and a value per layer, in the dtype the model loads in (float32: TRL's default)
    model = json.loads((TINY_MODEL / "config.json").read_text())
    per_token = 2 * model["num_hidden_layers"] * model["num_key_value_heads"] * model["head_dim"] * 4
    largest = max(s.batch for s in pinned.plan.shapes if s.phase == "generate")
    assert advice_to_dict(advice)["alternatives"][advice.options.index(pinned)]["kv_cache_peak_bytes"] == \
        largest * 639 * per_token
    assert peak_bytes(advice.baseline.plan) == max(s.batch * (s.cache_len or 0) for s in advice.baseline.plan.shapes
                                                   if s.phase == "generate") * per_token
    header = next(line for line in render_advice(advice).splitlines() if line.startswith("option"))
    assert "KV cache" in header.split("  ")
    # the guide's example loads a float32 model with a static cache, which generates (plan/caveats.py): no caveat
    assert not any("#7664" in w for w in advice.warnings)


def test_max_completion_length_caps_lose_data_and_are_exact() -> None:
    argv = [*GRPO_ARGV, "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length",
            "256", "--cache_implementation", "static", "--pad_to_multiple_of", "128", "--max_steps", "4"]
    advice = advise("grpo", argv)
    cap = next(o for o in advice.options if o.label == "max_completion_length 128")
    assert cap.loss.completions_capped == 128 and cap.loss.loses_data
    _check_every_row("grpo", advice)


def test_sft_alternatives_share_one_tokenization(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = lengths_module._token_lengths
    monkeypatch.setattr(lengths_module, "_token_lengths", lambda job, **kw: calls.append(job) or real(job, **kw))
    advice = advise("sft", SFT_ARGV, use_cache=False)
    assert len(advice.options) > 10
    assert len(calls) == 1
    analyze("sft", SFT_ARGV, use_cache=False)  # outside advise each plan tokenizes
    assert len(calls) == 2


def _plan(shapes: tuple[Shape, ...], tokens: int = 100, **config: object) -> Plan:
    stats = PlanStats(rows=10, dropped_rows=0, micro_batches=sum(s.count for s in shapes), optimizer_steps=1,
                      tokens=tokens, padded_tokens=tokens)
    return Plan(method="sft", exact=True, pad_to_multiple_of=128, shapes=shapes, stats=stats, config=dict(config))


def test_kv_cache_peak_is_the_largest_static_allocation() -> None:
    facts = {"layers": 28, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}  # Qwen3-0.6B
    generate = (Shape(phase="generate", batch=8, seq=512, count=3, first_step=1, cache_len=1023),
                Shape(phase="generate", batch=2, seq=1024, count=1, first_step=2, cache_len=1535))
    plan = _plan(generate, dtype="auto", attention=facts)  # auto: the checkpoint's own dtype
    assert token_bytes(plan) == 2 * 28 * 8 * 128 * 2
    assert peak_bytes(plan) == 8 * 1023 * token_bytes(plan)  # batch x cache length, not the longest cache alone
    assert token_bytes(_plan(generate, dtype="float32", attention=facts)) == 2 * token_bytes(plan)
    assert peak_bytes(_plan(generate, dtype="auto", attention={**facts, "layers": None})) is None  # unreadable
    dynamic = tuple(replace(s, cache_len=None) for s in generate)
    assert peak_bytes(_plan(dynamic, dtype="auto", attention=facts)) is None


def test_cost_model_is_anchored_on_the_guide() -> None:
    model = CostModel()
    shape = Shape(phase="train", batch=4, seq=1024, count=1, first_step=1)
    assert model.step_seconds(shape, torch_compile=False) == pytest.approx(1.71)
    assert model.step_seconds(shape, torch_compile=True) == pytest.approx(1.15)
    assert model.compile_seconds(shape) == 60
    assert model.compile_seconds(Shape(phase="generate", batch=4, seq=128, count=1, first_step=1, cache_len=255,
                                       max_new_tokens=128)) == 720
    longer = Shape(phase="train", batch=4, seq=2048, count=1, first_step=1)
    assert model.step_seconds(longer, torch_compile=False) > 2 * 1.71 - model.step_fixed_s
    assert set(model.to_dict()) >= {"step_fixed_s", "step_token_s", "step_attention_s", "formula", "source"}


def test_calibration_fits_compile_and_step_seconds() -> None:
    base = CostModel()
    shape = Shape(phase="train", batch=4, seq=1024, count=1, first_step=1)
    measured = [Measurement(phase="train", batch=4, seq=1024, compile_s=30.5, steady_s=0.5),
                Measurement(phase="generate", batch=4, seq=128, compile_s=100.0, steady_s=None)]
    model = calibrated(measured, torch_compile=False, source="here")
    assert model.train_compile_s == pytest.approx(30.0)
    assert model.generate_compile_s == pytest.approx(100.0)
    assert model.step_seconds(shape, torch_compile=False) == pytest.approx(0.5)
    assert base.step_seconds(shape, torch_compile=False) == pytest.approx(1.71)
    assert model.source.startswith("here (2 shapes, 1 with steady-state")


def test_recommendation_needs_allow_truncation_for_a_lossy_change() -> None:
    plan = _plan((Shape(phase="train", batch=4, seq=256, count=1, first_step=1),))

    def option(label: str | None, total: float, loss: DataLoss | None = None) -> Option:
        candidate = Candidate(label, (("max_length", "128"),)) if label else None
        return Option(candidate=candidate, plan=plan, cost=PlanCost({"train": 1}, total, 0.0),
                      loss=loss or DataLoss())

    baseline = option(None, 100.0)
    lossy = option("max_length 128", 10.0, DataLoss(rows_truncated=3, tokens_lost=40))
    chosen, line = recommendation(baseline, [lossy], allow_truncation=False)
    assert chosen is None and "keep the current settings" in line and "--allow-truncation" in line
    chosen, line = recommendation(baseline, [lossy], allow_truncation=True)
    assert chosen is lossy and line.startswith("recommendation: --max_length 128:") and "3 rows truncated" in line
    named = Option(candidate=Candidate("shorter rows", (("max_length", "128"),)), plan=plan,
                   cost=PlanCost({"train": 1}, 10.0, 0.0), loss=lossy.loss)
    # a label that only repeats the flags is left out; one that says more is kept
    assert recommendation(baseline, [named], allow_truncation=True)[1].startswith(
        "recommendation: --max_length 128 (shorter rows): ")


def test_candidates_cover_the_issue_levers() -> None:
    sft = candidates(Settings(method="sft", lengths="rows", pad_to_multiple_of=128, per_device_train_batch_size=4,
                              gradient_accumulation_steps=2, max_length=512, longest_row=900))
    labels = [c.label for c in sft]
    assert labels == ["pad_to_multiple_of 64", "pad_to_multiple_of 256", "pad_to_multiple_of 512",
                      "pad_to_multiple_of none", "max_length 384", "max_length 256", "max_length 128",
                      "bfd packing", "padding_free", "batch 1 x accumulation 8", "batch 2 x accumulation 4",
                      "batch 8 x accumulation 1"]
    grpo = candidates(Settings(method="grpo", lengths="prompts", pad_to_multiple_of=128, per_device_train_batch_size=4,
                               gradient_accumulation_steps=1, max_completion_length=384, pin_cache_len=639,
                               generation_kwargs={"temperature": 0.7}))
    pin = next(c for c in grpo if c.label == "pin max_cache_len 639")
    assert json.loads(dict(pin.flags)["generation_kwargs"]) == {"temperature": 0.7, "max_cache_len": 639}
    assert [c.label for c in grpo if c.caps_completions] == ["max_completion_length 256", "max_completion_length 128"]


def test_histogram_fits_80_columns_and_marks_bucket_edges() -> None:
    lengths = [5] * 100_000 + list(range(1, 40_000, 7)) + [50_000] * 3
    text = histogram(lengths, 128, 32_768, what="rows")
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    lines = text.splitlines()[1:]
    assert len(lines) <= 25
    assert "32769-50000" in lines[-1] and ">max" in lines[-1]
    assert lines[-1].endswith(f" {sum(1 for n in lengths if n > 32_768):,}")
    # 256 buckets of 128 merged by 11 into bins of 1408 tokens
    assert lines[0].split()[0] == "1-1408"
    assert lines[0].endswith(f" {sum(1 for n in lengths if n <= 1408):,}")
    small = histogram([1, 128, 129, 256, 300], 128, None, what="rows").splitlines()[1:]
    assert [line.split()[0] for line in small] == ["1-128", "129-256", "257-384"]
    assert [line.split()[-1] for line in small] == ["2", "2", "1"]


def test_html_page_is_one_self_contained_document() -> None:
    advice = advise("sft", SFT_ARGV)
    page = render_html(advice)
    root = ET.fromstring(page.split("\n", 1)[1])  # well-formed XML after the doctype
    ns = {"h": "http://www.w3.org/1999/xhtml", "s": "http://www.w3.org/2000/svg"}
    assert root.findall(".//s:svg/s:rect", ns)
    what_if, shapes = (root.find(f".//h:table[@class='{name}']", ns) for name in ("what-if", "shapes"))
    assert what_if is not None and shapes is not None
    assert len(what_if.findall(".//h:tbody/h:tr", ns)) == 1 + len(advice.options)
    assert len(shapes.findall(".//h:tbody/h:tr", ns)) == len(advice.baseline.plan.shapes)
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/1999/xhtml"', "") \
        .replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page
    text = render_advice(advice)
    assert advice.recommendation in text
    # the recommendation's command, whole and as `trl sft` parses it, its change last
    run_it = advice.recommended_command()
    assert run_it is not None and advice.recommended is not None and advice.recommended.candidate is not None
    assert f"run it: {run_it.line()}" in text.splitlines()
    assert run_it.words[-len(advice.recommended.candidate.argv()):] == tuple(advice.recommended.candidate.argv())
    _trl_parse("sft", list(run_it.words))
    assert all(len(line) <= WIDTH for line in text.split("what-if")[0].splitlines())
    data = advice_to_dict(advice)
    assert data["cost_model"]["step_fixed_s"] == CostModel().step_fixed_s
    assert len(data["alternatives"]) == len(advice.options)


def test_caveats_name_the_fix() -> None:
    generate = _plan((Shape(phase="train", batch=4, seq=256, count=1, first_step=1),
                      Shape(phase="train", batch=4, seq=384, count=1, first_step=1)),
                     cache_implementation="static", dtype="float32", torch_compile=True)
    found = caveats(generate, {"NEURON_RT_VISIBLE_CORES": "1,2"})
    assert len(found) == 2  # a float32 static cache generates (see caveats.py): no caveat
    assert "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0" in found[0] and "#7660" in found[0]
    assert "export NEURON_RT_VISIBLE_CORES=0-1" in found[1]
    fixed = _plan(generate.shapes, cache_implementation="static", dtype="bfloat16", torch_compile=True)
    for cores in ("0,1", "2-3", "0-3", "5"):
        assert caveats(fixed, {"NEURON_RT_VISIBLE_CORES": cores, "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES": "0"}) == []


def test_the_nki_caveat_is_for_eager_attention_only() -> None:
    """Under torch_compile the attention is part of the graph, keyed by its StableHLO: no per-process key."""
    shapes = (Shape(phase="train", batch=1, seq=512, count=2, first_step=1, unpadded=2),)
    assert any("NKI flash-attention" in line for line in caveats(_plan(shapes), {}))
    assert not any("NKI" in line for line in caveats(_plan(shapes, torch_compile=True), {}))


def _shapeplan(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "shapeplan"), *args], check=False, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=600)


def test_cli_advise_json_html_and_errors(tmp_path: Path) -> None:
    page = tmp_path / "advice.html"
    done = _shapeplan("advise", str(CAPYBARA), "--model", str(TINY_MODEL), "--per_device_train_batch_size", "4",
                      "--json", "--html", str(page))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["baseline"]["shapes_per_phase"] == {"train": 7}
    assert data["recommendation"].startswith("recommendation: ")
    assert "formula" in data["cost_model"]
    ET.fromstring(page.read_text().split("\n", 1)[1])
    # settings as the command line takes them, not TRL's enum names (IntervalStrategy.NO)
    assert "<th>eval_strategy</th><td>no</td>" in page.read_text() and "Strategy." not in page.read_text()

    wrong = _shapeplan("advise", "--method", "dpo", str(CAPYBARA), "--model", str(TINY_MODEL))
    assert wrong.returncode == 2 and wrong.stderr.startswith("Error: advise covers sft") and \
        len(wrong.stderr.splitlines()) == 1
    missing = _shapeplan("advise", str(CAPYBARA), "--model", str(TINY_MODEL), "--calibrate", str(tmp_path / "none"))
    assert missing.returncode == 1 and "has no shapeplan-manifest.json" in missing.stderr
    assert len(missing.stderr.splitlines()) == 1
    unwritable = _shapeplan("advise", str(CAPYBARA), "--model", str(TINY_MODEL), "--html",
                            str(tmp_path / "no" / "dir" / "a.html"))
    assert unwritable.returncode == 1 and unwritable.stderr.startswith("Error: cannot write")
    assert len(unwritable.stderr.splitlines()) == 1


def test_cli_analyze_histogram_and_caveats() -> None:
    done = _shapeplan("analyze", str(CAPYBARA), "--model", str(TINY_MODEL), "--histogram", "--torch_compile", "true",
                      "--per_device_train_batch_size", "4",
                      env={"NEURON_RT_VISIBLE_CORES": "1,2"})
    assert done.returncode == 0, done.stderr
    table, hist = done.stdout.split("rows per bucket")
    assert "distinct shapes to compile: 7" in table
    assert [line.split()[-1] for line in hist.splitlines()[1:]] == ["11", "37", "22", "11", "7", "5", "2", "1"]
    assert "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0" in done.stderr and "NEURON_RT_VISIBLE_CORES=0-1" in done.stderr


@pytest.mark.slow
def test_warm_records_steady_seconds_and_advise_calibrates_with_them(tmp_path: Path) -> None:
    from tests.warm.harness import plan_for, run_argv, warm_plan

    argv = ["--max_length", "256", "--per_device_train_batch_size", "2", "--max_steps", "2"]
    plan = plan_for("sft", CAPYBARA, argv, tmp_path / "out")
    cache = tmp_path / "cache"
    report = warm_plan(plan, cache)
    assert all(r.steady_seconds is not None and r.steady_seconds > 0 for r in report.results)
    (section,) = json.loads((cache / "shapeplan-manifest.json").read_text())["environments"].values()
    steady = {key: entry["steady_seconds"] for key, entry in section["shapes"].items()}
    assert len(steady) == len(report.results)

    advice = advise("sft", run_argv(CAPYBARA, argv, tmp_path / "out"), calibrate=cache)
    assert advice.model.source.startswith(f"calibrated from {cache}")
    shape = plan.shapes[0]
    measured = steady[report.results[0].task.key]
    assert advice.model.step_seconds(shape, torch_compile=False) == pytest.approx(measured, rel=1e-3)
    assert advice.model.train_compile_s == CostModel().train_compile_s  # eager CPU compiled nothing


def _trl_parse(method: str, words: list[str]) -> list[object]:
    """`words` (a printed `trl METHOD ...` command) through `trl METHOD`'s own parser, as the CLI parses it."""
    import importlib

    from shapeplan.services.trainers import trainer_spec

    assert words[:2] == ["trl", method]
    parser = importlib.import_module(trainer_spec(method).script).make_parser()
    # `--use_cpu true`: TrainingArguments refuses bf16 on a machine with no accelerator, such as this one
    return list(parser.parse_args_and_config([*words[2:], "--use_cpu", "true"], fail_with_unknown_args=True))


def test_printed_commands_parse_with_trl_and_name_every_split_and_a_reward() -> None:
    """A local data file becomes a dataset folder `load_dataset` reads (TRL reads no data file), the eval file its
    test split, under the run's split names; GRPO gets a reward TRL has registered, said to be a placeholder (the
    real `trl sft` run of a printed command: tests/warm/test_inductor_cache.py)."""
    from datasets import load_dataset

    from shapeplan.services.trl_command import PLACEHOLDER_REWARD, trl_command

    eval_file = ROOT / "tests" / "fixtures" / "assistant-chat.jsonl"
    command = trl_command("sft", [*SFT_ARGV, "--eval_strategy", "steps", "--eval_steps", "2",
                                  "--dataset_test_split", "held_out"], eval_source=str(eval_file))
    script, training, model, *_ = _trl_parse("sft", list(command.words))
    assert model.model_name_or_path == str(TINY_MODEL) and training.pad_to_multiple_of == 128  # as planned
    data = load_dataset(script.dataset_name)
    assert {split: len(rows) for split, rows in data.items()} == {"train": 96, "held_out": 24}
    assert command.notes == ()

    # one split name for both: the eval file keeps a split of its own, not the train file's (it replaced it before)
    same = trl_command("sft", [*SFT_ARGV, "--eval_strategy", "steps", "--eval_steps", "2",
                               "--dataset_test_split", "train"], eval_source=str(eval_file), device="cpu")
    assert same.words[-2:] == ("--use_cpu", "true")  # as printed on a CPU host, it runs there
    script, *_ = _trl_parse("sft", list(same.words))
    data = load_dataset(script.dataset_name)
    assert script.dataset_test_split == "eval" and {s: len(r) for s, r in data.items()} == {"train": 96, "eval": 24}

    grpo = trl_command("grpo", GRPO_ARGV)
    script, *_ = _trl_parse("grpo", list(grpo.words))
    assert script.reward_funcs == [PLACEHOLDER_REWARD] and "placeholder" in grpo.notes[0]
    assert len(load_dataset(script.dataset_name)["train"]) == 64


def test_what_warm_prints_to_train_with() -> None:
    """After a warm-up: a script's plan, its command under the guard; a `trl` run's plan, its `trl` command with the
    eval file the plan was made with (recorded in the plan), under the guard where the warm-up needed a setting no
    environment variable carries (dynamo's recompile limit above its default)."""
    from datasets import load_dataset

    from shapeplan.plan.model import Plan
    from shapeplan.services.trl_command import training_command

    eval_file = str(ROOT / "tests" / "fixtures" / "assistant-chat.jsonl")
    argv = [*SFT_ARGV, "--eval_strategy", "steps", "--eval_steps", "2"]
    plan = Plan(method="sft", exact=True, pad_to_multiple_of=128, stats=None, shapes=(),
                config={"argv": argv, "eval_dataset": eval_file})
    plain = training_command(plan, "plan.json", eval_source=None, device="cpu", python_lines=[])
    assert plain is not None and plain.words[:2] == ("trl", "sft")
    script, *_ = _trl_parse("sft", list(plain.words))
    assert len(load_dataset(script.dataset_name)["test"]) == 24  # the recorded eval file, not the train file
    limit = ["torch._dynamo.config.recompile_limit = 12"]
    guarded = training_command(plan, "plan.json", eval_source=None, device="cpu", python_lines=limit)
    assert guarded is not None and guarded.words == ("shapeplan", "guard", "--plan", "plan.json", "--", *plain.words)
    assert "recompile_limit = 12" in guarded.notes[0]
    scripted = Plan(method="sft", exact=True, pad_to_multiple_of=128, stats=None, shapes=(),
                    config={"argv": [], "command": ["python", "train.py"]})
    command = training_command(scripted, "p.json", eval_source=None, device="cpu", python_lines=limit)
    assert command is not None and command.line() == "shapeplan guard --plan p.json -- python train.py"
