"""Vision-language SFT and GRPO through the installed console script: the plan carries each batch's pixel rows and
grids, the report counts the vision graphs, and every input TRL or shapeplan refuses is one line and a non-zero exit
code."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from tests import console
from tests.conftest import TINY_MODEL, TINY_VL_MODEL
from tests.oracle.vision_data import write_images, write_prompts, write_rows

RUN = ["analyze", "--method", "sft", "--per_device_train_batch_size", "2", "--max_steps", "3",
       "--pad_to_multiple_of", "128", "--max_length", "1024"]


def test_vision_plans_and_refusals(tmp_path: Path) -> None:
    images = write_images(tmp_path / "images")
    data = write_rows(tmp_path / "train.jsonl", images, 6, seed=3)
    result = console.run([*RUN, str(data), "--model", str(TINY_VL_MODEL), "--json"])
    assert result.returncode == 0, result.stderr
    shapes = json.loads(result.stdout)["shapes"]
    assert all(len(s["pixel_values"]) == 2 and s["image_grid_thw"] for s in shapes if "pixel_values" in s)
    Image.new("RGB", (1000, 900)).save(images[0])  # the same path, another size: not answered from the plan cache
    again = json.loads(console.run([*RUN, str(data), "--model", str(TINY_VL_MODEL), "--json"]).stdout)["shapes"]
    assert again != shapes
    shapes = again
    report = console.run([*RUN, str(data), "--model", str(TINY_VL_MODEL)])
    assert "vision graphs: " in report.stdout and "pixel_values " in report.stdout, report.stdout
    assert f"row layouts: {sum(len(s['text_runs']) for s in shapes)} " in report.stdout, report.stdout
    histogram = console.run(["analyze", "--histogram", *RUN[1:], str(data), "--model", str(TINY_VL_MODEL)])
    assert histogram.returncode != 0 and "text lengths" in histogram.stderr, histogram.stderr
    assert len(histogram.stderr.strip().splitlines()) == 1, histogram.stderr
    # a plan whose vision batches lost their rows' layouts (an observed plan has none): warm cannot feed it
    # and one whose row is longer than its entry's seq: warm would feed another shape than it names
    plan = json.loads(console.run([*RUN, str(data), "--model", str(TINY_VL_MODEL), "--json"]).stdout)
    edited = json.loads(json.dumps(plan))
    edited["shapes"][0]["text_runs"][0][0][0] = edited["shapes"][0]["seq"]
    for shape in plan["shapes"]:
        shape.pop("text_runs")
    for name, edit, message in (("no-layouts", plan, "lack their rows' layouts (text_runs)"),
                                ("long-row", edited, "re-create the plan with `shapeplan analyze`")):
        (tmp_path / f"{name}.json").write_text(json.dumps(edit))
        result = console.run(["warm", "--plan", str(tmp_path / f"{name}.json"), "--device", "cpu", "--cache-dir",
                              str(tmp_path / "cache")])
        assert result.returncode == 1 and message in result.stderr, (name, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "cache" / "shapeplan-manifest.json").exists()  # refused before any shape ran
    advice = json.loads(console.run(["advise", *RUN[1:], str(data), "--model", str(TINY_VL_MODEL), "--json"]).stdout)
    assert advice["vision"] and advice["baseline"]["vision_graphs"] == len(
        {tuple(map(tuple, s["image_grid_thw"])) for s in shapes if "image_grid_thw" in s})
    assert all(0 < o["pixels_kept"] <= 1 and (o["sizes"] or o["pixel_limits"]) for o in advice["options"])

    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    bad = tmp_path / "bad.jsonl"
    prompt_completion = tmp_path / "pc.jsonl"
    prompt_completion.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "completion": [
        {"role": "assistant", "content": "yo"}], "images": [images[0]]}) + "\n")
    cases = {  # exit 1: the data is at fault; 2: the options are
        "corrupt": (["--model", str(TINY_VL_MODEL)], "corrupt.png' cannot be used: not an image PIL can open", 1),
        "missing": (["--model", str(TINY_VL_MODEL)], "missing.png' cannot be used: no such file", 1),
        "text model": (["--model", str(TINY_MODEL)], "'qwen3' model", 2),
        "packing": (["--model", str(TINY_VL_MODEL), "--packing"], "TRL refuses packing on vision datasets", 2),
        "cut": (["--model", str(TINY_VL_MODEL), "--max_length", "128"], "cuts into them", 1),
        "not a multiple": (["--model", str(TINY_VL_MODEL), "--max_length", "600"], "pass --max_length 512", 2),
        "prompt-completion": (["--model", str(TINY_VL_MODEL)], "pass --pad_to_multiple_of none", 2),
        "string images": (["--model", str(TINY_VL_MODEL)], "'images' value that is a str, not a list", 1),
        "group_by_length": (["--model", str(TINY_VL_MODEL), "--train_sampling_strategy", "group_by_length"],
                            "fails on a vision dataset without a 'length' column", 2),
    }
    for case, (argv, message, code) in cases.items():
        source = prompt_completion if case == "prompt-completion" else bad if case in (
            "corrupt", "missing", "string images") else data
        if case == "string images":
            bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "images": images[0]}) + "\n")
        if case in ("corrupt", "missing"):
            broken = str(tmp_path / f"{case}.png")
            bad.write_text(data.read_text() + json.dumps({"messages": [{"role": "user", "content": "x"}, {
                "role": "assistant", "content": "y"}], "images": [broken]}) + "\n")
        result = console.run([*RUN, str(source), *argv])
        assert result.returncode == code and message in result.stderr, (case, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, (case, result.stderr)
    # the fix the refusal names runs
    fixed = console.run([*RUN, str(prompt_completion), "--model", str(TINY_VL_MODEL), "--pad_to_multiple_of", "none"])
    assert fixed.returncode == 0, fixed.stderr

    # GRPO: a string prompt; the plan; advise
    prompts = write_prompts(tmp_path / "prompts.jsonl", images, 4, seed=2)
    (tmp_path / "strings.jsonl").write_text(json.dumps({"prompt": "what is shown", "images": [images[0]]}) + "\n")
    grpo = ["--method", "grpo", "--model", str(TINY_VL_MODEL), "--num_generations", "2", "--max_completion_length",
            "16", "--max_steps", "2"]
    result = console.run(["analyze", str(tmp_path / "strings.jsonl"), *grpo, "--per_device_train_batch_size", "2"])
    assert result.returncode == 1 and "a prompt that is not a list of messages" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    # micro-batches cut from a shuffled round of 128 rows: more choices of prompts than shapeplan plans (MAX_SLICES)
    wide = console.run(["analyze", str(prompts), *grpo, "--per_device_train_batch_size", "64",
                        "--gradient_accumulation_steps", "2"])
    assert wide.returncode == 2 and wide.stderr.startswith("Error: steps_per_generation=2 on a vision-language grpo "
                                                           "run: ") and "(more than 10,000)" in wide.stderr, wide.stderr
    assert len(wide.stderr.strip().splitlines()) == 1, wide.stderr
    planned = console.run(["analyze", str(prompts), *grpo, "--per_device_train_batch_size", "2", "--json"])
    assert planned.returncode == 0, planned.stderr
    (tmp_path / "grpo-plan.json").write_text(planned.stdout)
    warm = console.run(["warm", "--plan", str(tmp_path / "grpo-plan.json"), "--device", "cpu", "--cache-dir",
                        str(tmp_path / "cache")])
    assert warm.returncode != 0 and "which warm feeds for SFT only, not yet for grpo" in warm.stderr, warm.stderr
    assert len(warm.stderr.strip().splitlines()) == 1, warm.stderr
    shapes = json.loads(planned.stdout)["shapes"]
    assert {s["phase"] for s in shapes if "pixel_values" in s} == {"generate", "train"}
    # advise weighs the prompts' image sizes: the what-if of one fixed size leaves one vision graph
    advised = console.run(["advise", str(prompts), *grpo, "--per_device_train_batch_size", "2", "--json"])
    assert advised.returncode == 0, advised.stderr
    advice = json.loads(advised.stdout)
    assert advice["baseline"]["vision_graphs"] == len(
        {tuple(map(tuple, s["image_grid_thw"])) for s in shapes if "image_grid_thw" in s})
    assert any(o["vision_graphs"] == 1 for o in advice["options"] if len(o["sizes"] or []) == 1), advice


def test_the_vision_demo_plans_and_advises_sizes_as_height_x_width(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`make demo-vision`'s commands, read from the Makefile and run as it runs them: the bundled images are small
    and `scripts/make_examples.py` makes them byte for byte; advise names each fixed size height x width, the order
    of the (height, width) pairs its `resize_images` line (and `resize_images`) takes."""
    import importlib.util
    import re
    import shlex

    from tests.conftest import EXAMPLES, ROOT

    recipe = (ROOT / "Makefile").read_text(encoding="utf-8").split("\ndemo-vision:")[1].split("\n\n")[0]
    commands = [shlex.split(line)[3:] for line in recipe.replace("\\\n", " ").splitlines()[1:]]  # after shapeplan
    assert [c[0] for c in commands] == ["analyze", "advise"]
    assert "HF_HUB_OFFLINE=1" in recipe
    planned = console.run(commands[0])
    assert planned.returncode == 0, planned.stderr
    assert "vision graphs: 11 distinct image batches" in planned.stdout, planned.stdout
    advised = console.run(commands[1])
    assert advised.returncode == 0, advised.stderr
    assert "fixed size (height x width)" in advised.stdout
    best = re.search(r"fewest compiles: \d+ fixed sizes? \(([^)]*)\)", advised.stdout)
    pairs = re.search(r"resize_images\(dataset, \[(.*)\]\)", advised.stdout)
    assert best is not None and pairs is not None, advised.stdout
    assert [tuple(int(n) for n in size.split("x")) for size in best.group(1).split(", ")] == \
        [tuple(int(n) for n in pair.split(", ")) for pair in re.findall(r"\((\d+, \d+)\)", pairs.group(1))]
    as_json = json.loads(console.run([*commands[1], "--json"]).stdout)
    for option in as_json["options"]:
        if option["sizes"]:
            assert option["option"].endswith("(" + ", ".join(f"{h}x{w}" for h, w in option["sizes"]) + ")"), option
    # the images: four sizes, small, and the script's own output
    images = sorted((EXAMPLES / "vision-demo").glob("*.png"))
    assert len(images) == 4 and sum(p.stat().st_size for p in images) < 20_000
    assert len({Image.open(p).size for p in images}) == 4
    spec = importlib.util.spec_from_file_location("make_examples", ROOT / "scripts" / "make_examples.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "ROOT", tmp_path)
    script.make_vision_demo()
    for made in [*sorted((tmp_path / "vision-demo").iterdir()), tmp_path / "vision-sample.jsonl"]:
        assert made.read_bytes() == (EXAMPLES / made.relative_to(tmp_path)).read_bytes(), made.name


def test_other_families_plan_through_the_console_and_their_generation_runs_are_refused(tmp_path: Path) -> None:
    """A SmolVLM plan names its images' keys `images` with its other tensors, its report counts its image batches;
    GRPO on the families whose micro-batches the shuffle decides (SmolVLM, LLaVA-NeXT, Gemma 3 with pan-and-scan)
    is one line, exit 2."""
    from tests.oracle.test_vision_families_oracle import BUILDERS

    images = write_images(tmp_path / "images")
    data = write_rows(tmp_path / "train.jsonl", images, 6, seed=3)
    model = BUILDERS["smolvlm"](tmp_path / "smolvlm")
    plan = json.loads(console.run([*RUN, str(data), "--model", str(model), "--json"]).stdout)
    assert plan["config"]["vision_family"] == "smolvlm"
    vision = [s for s in plan["shapes"] if "pixel_values" in s]
    assert vision and all(len(s["pixel_values"]) == 5 and s["images"] and "image_grid_thw" not in s
                          and list(s["vision_inputs"]) == ["pixel_attention_mask"] for s in vision)
    report = console.run([*RUN, str(data), "--model", str(model)])
    assert "vision graphs: " in report.stdout and "pixel_attention_mask " in report.stdout, report.stdout
    prompts = write_prompts(tmp_path / "prompts.jsonl", images, 4, seed=4)
    for name, refusal in (("smolvlm", "splits the image features"), ("llava_next", "unpadding"),
                          ("gemma3-pan-and-scan", "do_pan_and_scan")):
        folder = model if name == "smolvlm" else BUILDERS[name](tmp_path / name)
        result = console.run(["analyze", "--method", "grpo", str(prompts), "--model", str(folder),
                              "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_steps", "1"])
        assert result.returncode == 2 and refusal in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    # processor settings the arithmetic cannot use: one line naming the setting, exit 1
    for name, key, value, said in (("gemma3", "do_resize", False, "do_resize false"),
                                   ("llava_next", "patch_size", None, "no patch_size")):
        folder = tmp_path / name
        if not folder.exists():
            BUILDERS[name](folder)
        settings = json.loads((folder / "processor_config.json").read_text())
        # transformers 5 saves the image processor's settings inside processor_config.json
        held = settings["image_processor"] if key in settings.get("image_processor", {}) else settings
        held[key] = value
        (folder / "processor_config.json").write_text(json.dumps(settings))
        result = console.run([*RUN, str(data), "--model", str(folder)])
        assert result.returncode == 1 and said in result.stderr and str(folder) in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
