"""`--tools` and `--environment_factory` through the installed console script: named as `module:attr` (or TRL's
`module.attr`), on the command line or in the `--config` YAML, imported from the working directory; every way of
naming them wrongly is one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

from tests import console
from tests.conftest import CAPYBARA, TINY_MODEL

RUN = ["analyze", "--method", "grpo", "--model", str(TINY_MODEL), "--per_device_train_batch_size", "2",
       "--num_generations", "2", "--max_completion_length", "64", "--max_steps", "2", "--cache_implementation",
       "static", "--json"]
TOOLS = "tests.oracle.agentic_tools"
_HOW = ("shapeplan plans a rollout_func that generates through trainer._generate_single_turn or the trainer's model's "
        "own generate, makes the same calls whatever the model writes, and returns prompt_ids, completion_ids and "
        "logprobs")


def _prompts(tmp_path: Path) -> Path:
    lines = CAPYBARA.read_text(encoding="utf-8").splitlines()[:4]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": json.loads(line)["messages"][:1]}) + "\n" for line in lines),
                    encoding="utf-8")
    return path


def test_tools_named_on_the_command_line_or_in_the_config_are_planned(tmp_path: Path) -> None:
    data = _prompts(tmp_path)
    plain = json.loads(console.run([*RUN, data]).stdout)
    named = console.run([*RUN, data, "--tools", f"{TOOLS}:get_weather"])
    assert named.returncode == 0, named.stderr
    plan = json.loads(named.stdout)
    assert plan["config"]["tools"] == ["get_weather"]
    assert max(s["seq"] for s in plan["shapes"]) > max(s["seq"] for s in plain["shapes"])  # the schemas
    # the tool turns' bound: entries of their own, or more calls than certain on the rounds' own sizes (padded)
    assert any(s.get("certain") is False or s.get("max_count") for s in plan["shapes"] if s["phase"] == "generate")
    assert plan["config"]["pad_tool_turns"] is True
    # pinned at the longest length a call needs, the default with tools: one cache length (here the first call's
    # already, so no pin is recorded for the run to apply)
    assert len({s["cache_len"] for s in plan["shapes"] if s["phase"] == "generate"}) == 1
    assert "pin_cache" not in plan["config"]
    config = tmp_path / "run.yaml"
    config.write_text(f"tools:\n  - {TOOLS}.get_weather\nenvironment_factory: {TOOLS}:Calculator\n",
                      encoding="utf-8")
    both = console.run([*RUN, data, "--config", config])
    assert both.returncode == 0, both.stderr
    recorded = json.loads(both.stdout)["config"]
    assert recorded["tools"] == ["get_weather"] and recorded["environment_factory"] == f"{TOOLS}:Calculator"


def test_wrongly_named_objects_are_one_line_errors(tmp_path: Path) -> None:
    data = _prompts(tmp_path)
    (tmp_path / "broken_tools.py").write_text("raise RuntimeError('no network here')\n", encoding="utf-8")
    (tmp_path / "bare_tools.py").write_text("def lookup(x):\n    return x\n\nclass NoReset:\n    pass\n\n"
                                            "NUMBER = 3\n\ndef scripted(prompts, trainer):\n    return {'prompt_ids': "
                                            "[[1]] * len(prompts), 'completion_ids': [[2]] * len(prompts), "
                                            "'logprobs': None}\n\ndef branching(prompts, trainer):\n    ids = "
                                            "[[1] * 5] * len(prompts)\n    first, _ = trainer._generate_single_turn("
                                            "ids, None, {}, 1)\n    if len(first[0]) < 2:\n        "
                                            "trainer._generate_single_turn(ids, None, {}, 1)\n    return "
                                            "{'prompt_ids': ids, 'completion_ids': first, 'logprobs': None}\n"
                                            "\ndef scoring(prompts, trainer):\n    import torch\n    ids = "
                                            "torch.ones(len(prompts), 5, dtype=torch.long)\n    out = "
                                            "trainer.model_wrapped.generate(input_ids=ids, max_new_tokens=8)\n    "
                                            "trainer.model(out)\n\ndef lengthening(prompts, trainer):\n    import "
                                            "torch\n    ids = torch.ones(len(prompts), 5, dtype=torch.long)\n    out "
                                            "= trainer.model.generate(input_ids=ids, max_length=40)\n    again = "
                                            "trainer.model.generate(input_ids=out, max_length=40)\n    return "
                                            "{'prompt_ids': ids.tolist(), 'completion_ids': again[:, 5:].tolist(), "
                                            "'logprobs': None}\n",
                                            encoding="utf-8")
    cases = {
        ("--tools", "bare_tools"): "--tools 'bare_tools' names no object: write module:attr (a module importable "
                                   "from the working directory, and a name in it)",
        ("--tools", "missing_module:f"): "--tools 'missing_module:f': cannot import module 'missing_module': No "
                                         "module named 'missing_module'",
        ("--tools", "broken_tools:f"): "--tools 'broken_tools:f': importing module 'broken_tools' raised "
                                       "RuntimeError: no network here; fix the module so that it imports (the run "
                                       "imports it too)",
        ("--tools", "bare_tools:nothing"): "--tools 'bare_tools:nothing': module 'bare_tools' has no attribute "
                                           "'nothing'",
        ("--tools", "bare_tools:NUMBER"): "--tools 'bare_tools:NUMBER' holds int 3, not a function; name a function "
                                          "or a list of them",
        ("--environment_factory", "bare_tools:NoReset"): "the environment given has no reset method: GRPOTrainer "
                                                         "requires one (it is called before each rollout)",
        ("--rollout_func", "bare_tools:lookup"): "--rollout_func bare_tools:lookup, run on a batch of prompts by "
                                                 "shapeplan's dry run, raised TypeError: lookup() takes 1 positional "
                                                 "argument but 2 were given; " + _HOW,
        ("--rollout_func", "bare_tools:scripted"): "--rollout_func made no generate call (through "
                                                   "trainer._generate_single_turn or the model's generate): " + _HOW,
        # the model's own generate is planned; its forward (log-probs in the function) and calls whose settings
        # change with what the model writes are not
        ("--rollout_func", "bare_tools:scoring"): "--rollout_func runs the trainer's model other than through "
                                                  "generate, which shapeplan's dry run does not load: compute "
                                                  "log-probabilities after the rollout (return logprobs None), and "
                                                  "generate through trainer._generate_single_turn or the model's "
                                                  "generate",
        ("--rollout_func", "bare_tools:lengthening"): "--rollout_func's generate call 2 is made another way when the "
                                                      "model writes more (the model's generate with 34 new tokens and "
                                                      "a dynamic cache with the shortest completions, the model's "
                                                      "generate with 0 new tokens and a dynamic cache with the "
                                                      "longest): generate each call alike (the same path, "
                                                      "max_new_tokens and cache), whatever the model writes",
        ("--pad_tool_turns", "true"): "--pad_tool_turns pads the tool loop's generate calls, and the run has no "
                                      "tool loop; pass its --tools or --environment_factory, or drop "
                                      "--pad_tool_turns",
        ("--pin_cache", "true"): "--pin_cache pins the cache a tool loop's or a rollout function's generate calls "
                                 "grow, and the run has neither; pass its --tools, --environment_factory or "
                                 "--rollout_func, or drop --pin_cache",
        ("--rollout_func", "bare_tools:branching"): "--rollout_func makes other generate calls when the model writes "
                                                    "more (the rows of each call: [2, 2] with the shortest "
                                                    "completions, [2] with the longest): " + _HOW,
    }
    for (option, value), message in cases.items():
        result = console.run([*RUN, data, option, value], cwd=tmp_path)
        assert (result.returncode, result.stdout) == (2, ""), (option, value, result.stderr)
        assert result.stderr.splitlines() == [f"Error: {message}"], (option, value)
    undocumented = console.run([*RUN, data, "--tools", "bare_tools:lookup"], cwd=tmp_path)
    assert undocumented.returncode == 2 and undocumented.stderr.startswith(
        "Error: tool 'lookup': its schema cannot be built (") and undocumented.stderr.count("\n") == 1
    (tmp_path / "run.yaml").write_text("pad_tool_turns: 3\n", encoding="utf-8")  # a config file's value: unparsed
    unpadded = console.run([*RUN, data, "--tools", f"{TOOLS}:now", "--config", str(tmp_path / "run.yaml")])
    assert (unpadded.returncode, unpadded.stderr) == (2, "Error: pad_tool_turns is 3 in the config file; set it to "
                                                         "true or false\n")
    # --pin_cache where the run has no pin to take: a dynamic cache, or its own max_cache_len
    for extra, message in ((["--cache_implementation", "dynamic"], "--pin_cache pins a static cache, and the run's is "
                                                                     "dynamic; pass --cache_implementation static, or "
                                                                     "drop --pin_cache"),
                           (["--generation_kwargs", '{"max_cache_len": 1024}'],
                            "--pin_cache pins the cache at the longest length the run needs, and --generation_kwargs "
                            "already pins it at max_cache_len 1024; drop one of them")):
        result = console.run([*RUN, data, "--tools", f"{TOOLS}:now", "--pin_cache", "true", *extra])
        assert (result.returncode, result.stderr) == (2, f"Error: {message}\n"), result.stderr
    planned = console.run([*RUN, data, "--rollout_func", f"{TOOLS}:two_turns", "-o", str(tmp_path / "plan.json")])
    assert planned.returncode == 0, planned.stderr
    rloo = console.run([*RUN[:2], "rloo", *RUN[3:], data, "--tools", f"{TOOLS}:get_weather"])
    assert rloo.returncode == 2
    assert rloo.stderr == "Error: --tools is not an argument `rloo`'s trainer takes; drop it\n"


def test_the_trl_command_of_a_run_with_tools_leaves_them_out_and_says_so(tmp_path: Path) -> None:
    """`trl grpo` has no option for Python objects: the command warm and advise print carries the run's TRL options
    (it runs as printed) and a note to hand the tools over in the user's own script."""
    from shapeplan.services.trl_command import trl_command
    from tests.cli.test_advise import _trl_parse

    argv = ["--dataset_name", str(_prompts(tmp_path)), "--model_name_or_path", str(TINY_MODEL),
            "--tools", f"{TOOLS}:get_weather", f"{TOOLS}:now", "--max_steps", "2",
            f"--environment_factory={TOOLS}:Calculator", "--reward_funcs", "accuracy_reward"]  # padded: the default
    command = trl_command("grpo", argv)
    assert [w for w in command.words if "agentic_tools" in w or w.startswith(("--tools", "--environment"))] == []
    # a plan that pins the cache (the default with tools): its options carry the pin, which the script must set
    pinned = trl_command("grpo", [*argv, "--generation_kwargs", '{"temperature": 0.5}', "--pin_cache", "true"],
                         pin_cache=1151)
    assert pinned.words[pinned.words.index("--generation_kwargs") + 1] == '{"temperature": 0.5, "max_cache_len": 1151}'
    assert "--pin_cache" not in pinned.words and "the plan's cache pin (max_cache_len 1151)" in pinned.notes[0]
    _, config, *_ = _trl_parse("grpo", list(pinned.words))  # TRL's own parser takes it as printed
    assert config.generation_kwargs == {"temperature": 0.5, "max_cache_len": 1151}
    assert command.words[-6:] == ("--max_steps", "2", "--reward_funcs", "accuracy_reward", "--pad_to_multiple_of",
                                  "128")
    (note,) = command.notes
    assert note.startswith("`trl grpo` cannot pass tools=['get_weather', 'now'], environment_factory="
                           f"{TOOLS}:Calculator: train with your own script, which hands them to the trainer, "
                           "and call shapeplan.pad_tool_turns(trainer) before training")


def test_advise_offers_padded_tool_turns_and_says_how_to_run_them(tmp_path: Path) -> None:
    """A run with tools planned unpadded: advise offers --pad_tool_turns (one generate batch a turn shape, not each
    of 1..R), and the command it prints for it is the run's `trl grpo` command, which cannot take it, with a note to
    pad in the user's script."""
    from shapeplan.services.advice_report import render_advice
    from shapeplan.services.advise import advise
    from tests.cli.test_advise import _trl_parse

    argv = ["--dataset_name", str(_prompts(tmp_path)), "--model_name_or_path", str(TINY_MODEL),
            "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "64",
            "--max_steps", "2", "--cache_implementation", "static", "--tools", f"{TOOLS}:get_weather",
            "--max_tool_calling_iterations", "2", "--pad_tool_turns", "false"]
    advice = advise("grpo", argv, use_cache=False)
    padded = next(o for o in advice.options if o.candidate and o.candidate.flags == (("pad_tool_turns", "true"),))
    assert {s.batch for s in advice.baseline.plan.shapes if s.phase == "generate"} == {1, 2, 3, 4}
    assert {s.batch for s in padded.plan.shapes if s.phase == "generate"} == {4}
    assert advice.recommended is padded
    command = advice.recommended_command()
    assert command is not None and "--pad_tool_turns" not in command.words
    _trl_parse("grpo", list(command.words))
    text = render_advice(advice)
    assert f"run it: {command.line()}" in text
    assert "and call shapeplan.pad_tool_turns(trainer) before training" in text


def test_tools_keep_the_guides_example_need_conversational_prompts_and_bounds_read_as_bounds(tmp_path: Path) -> None:
    """`--tools` alone keeps the Trainium guide's example settings and says so; tools on plain-string prompts (which
    TRL's tool loop fails on at step 1) are refused in one line; a report shows a bound's count as `<=N` and how many
    possible entries there are to certain ones, and once the cache is pinned the plan no longer says to pin it."""
    from tests.conftest import TLDR

    data = _prompts(tmp_path)
    tools = ["--tools", f"{TOOLS}:get_weather"]
    guide = console.run(["analyze", "--method", "grpo", data, "--model", TINY_MODEL, *tools, "--json"])
    assert guide.returncode == 0, guide.stderr
    plan = json.loads(guide.stdout)
    config = plan["config"]
    assert (config["per_device_train_batch_size"], config["max_completion_length"], config["cache_implementation"]) \
        == (4, 128, "static")
    (note,) = [w for w in plan["warnings"] if w.startswith("no training option given")]
    assert "Trainium guide GRPO example" in note and "with the run's --tools" in note, note
    table = console.run(["analyze", "--method", "grpo", data, "--model", TINY_MODEL, *tools]).stdout
    bounds = [line.split() for line in table.splitlines() if line.startswith("generate") and "possible" in line]
    assert bounds and all(row[3].startswith("<=") for row in bounds), table  # phase, batch, seq, count, ...
    # how wide the bound is, beside what the run will meet for certain
    certain = sum(s.get("certain", True) for s in plan["shapes"])
    possible = len(plan["shapes"]) - certain
    assert f"agentic bound: {possible} possible entries to {certain} certain ({possible / certain:.1f} to 1)" in table
    plain = console.run(["analyze", "--method", "grpo", TLDR, "--model", TINY_MODEL, *tools])
    assert plain.returncode == 2 and plain.stderr.count("\n") == 1, plain.stderr
    assert plain.stderr.startswith("Error: --tools needs conversational prompts, and the train dataset's are plain "
                                   "strings") and '[{"role": "user", "content": "..."}]' in plain.stderr
    pinned = console.run([*RUN, data, *tools, "--generation_kwargs", '{"max_cache_len": 1024}'])
    assert pinned.returncode == 0, pinned.stderr
    warnings = json.loads(pinned.stdout)["warnings"]
    assert any(w.startswith("tool calls make shapes") for w in warnings)
    assert not any("max_cache_len" in w for w in warnings), warnings


def test_warm_checks_the_tools_schemas_before_building_a_trainer(tmp_path: Path) -> None:
    """A plan made with a tool whose docstring is gone by the warm-up: one line naming the tool, exit 2, before any
    trainer is built, and the cache dir the warm-up made is removed."""
    data = _prompts(tmp_path)
    module = tmp_path / "my_tools.py"
    module.write_text('def lookup(city: str) -> str:\n    """Look a city up.\n\n    Args:\n        city: The city.\n'
                      '    """\n    return city\n', encoding="utf-8")
    planned = console.run([*RUN, data, "--tools", "my_tools:lookup", "-o", tmp_path / "plan.json"], cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr[-2000:]
    module.write_text("def lookup(city: str) -> str:\n    return city\n", encoding="utf-8")
    cache = tmp_path / "cache"
    warmed = console.run(["warm", "--plan", tmp_path / "plan.json", "--device", "cpu", "--cache-dir", cache],
                         cwd=tmp_path)
    errors = [line for line in warmed.stderr.splitlines() if line.startswith("Error: ")]
    assert warmed.returncode == 2 and len(errors) == 1 and "tool 'lookup'" in errors[0], warmed.stderr[-2000:]
    assert "Traceback" not in warmed.stderr and not cache.exists()
