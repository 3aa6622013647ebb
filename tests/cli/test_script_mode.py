"""Script mode: `shapeplan analyze -- python train.py` plans the run the user's own script builds, taken from the
trainer it trains: its mapped, filtered and shuffled data, its config object, its PEFT config object, its launcher's
process count. Checked through the installed console script against the same script's real run (recorded by the
guard), against the same run restated as TRL options, and on every way a script can go wrong. (A GRPO script with
its own tool and reward, warmed from the plan and trained under the printed guard command with nothing compiled:
tests/guard/test_agentic_compiles.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from shapeplan.plan.io import load_plan, plan_from_dict
from tests import console
from tests.conftest import CAPYBARA, ROOT, TINY_MODEL

HEAD = f"""import sys
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer

MODEL = {str(TINY_MODEL)!r}
DATA = {str(CAPYBARA)!r}
"""

# the user's preprocessing: rows filtered, a system turn mapped in, shuffled with a seed; a LoRA config object
SFT = HEAD + """from peft import LoraConfig

import prompts  # a module beside the script

rows = load_dataset("json", data_files=DATA, split="train").select(range(24))
rows = rows.filter(lambda row: len(row["messages"]) <= 6)
rows = rows.map(lambda row: {"messages": [{"role": "system", "content": prompts.SYSTEM}] + row["messages"]})
rows = rows.shuffle(seed=3)
split = rows.train_test_split(test_size=4, seed=0)
config = SFTConfig(output_dir="out", per_device_train_batch_size=4, per_device_eval_batch_size=2, max_length=512,
                   num_train_epochs=1, eval_strategy="steps", eval_steps=2, pad_to_multiple_of=128, bf16=False,
                   use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)
print("building the trainer")  # a script's own output: never on --json's stdout
trainer = SFTTrainer(model=MODEL, args=config, train_dataset=split["train"], eval_dataset=split["test"],
                     peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
trainer.train()
"""


def _files(folder: Path, script: str) -> Path:
    (folder / "prompts.py").write_text('SYSTEM = "Answer in one line."\n', encoding="utf-8")
    (folder / "train.py").write_text(script, encoding="utf-8")
    return folder


def _run(*args: str | Path, cwd: Path) -> console.subprocess.CompletedProcess[str]:
    return console.run(args, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _shapes(plan_or_record: object) -> list[tuple[str, int, int, int]]:
    return sorted((s.phase, s.batch, s.seq, s.count) for s in plan_or_record.shapes)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_script_is_planned_as_its_real_run_meets_it(tmp_path: Path) -> None:
    """The plan of the script equals the shapes the script's real run feeds the model (train and eval), and
    analyze leaves nothing behind (the trainer never trains; no output_dir)."""
    folder = _files(tmp_path, SFT)
    result = _run("analyze", "--json", "-o", "plan.json", "--", "python", "train.py", cwd=folder)
    assert result.returncode == 0, result.stderr[-2000:]
    plan = plan_from_dict(json.loads(result.stdout))  # the script's print went to stderr
    assert "building the trainer" in result.stderr
    assert not (folder / "out").exists()
    line = SFT.splitlines().index(next(t for t in SFT.splitlines() if t.startswith("trainer = "))) + 1
    assert plan.config["command"] == ["python", "train.py"]
    assert plan.config["trainer"] == f"SFTTrainer (train.py:{line})"
    assert {s.phase for s in plan.shapes} == {"train", "eval"}
    assert "next: shapeplan warm --plan plan.json, then train with `shapeplan guard --plan plan.json -- python " \
           "train.py`" in result.stderr

    record = folder / "run.json"
    guarded = _run("guard", "--plan", "plan.json", "--record", record, "--", "python", "train.py", cwd=folder)
    assert guarded.returncode == 0, guarded.stderr[-2000:]
    assert _shapes(load_plan(record)) == _shapes(plan)


def test_a_script_plans_as_the_same_run_restated_as_options(tmp_path: Path) -> None:
    """A script that loads a file and trains with a default-built config (no pad_to_multiple_of: TRL's "auto", 128 on
    Trainium; TRL's bf16 default, which a CPU refuses unless planning builds it for the CPU) under a two-process
    launcher plans as `analyze FILE --model M OPTIONS --num_processes 2`; the Python API gives the same plan."""
    script = HEAD + """rows = load_dataset("json", data_files=DATA, split="train")
config = SFTConfig(output_dir="out", per_device_train_batch_size=4, max_length=1024, seed=7)
SFTTrainer(model=MODEL, args=config, train_dataset=rows).train()
"""
    folder = _files(tmp_path, script)
    restated = _run("analyze", "--json", CAPYBARA, "--model", TINY_MODEL, "--per_device_train_batch_size", "4",
                    "--max_length", "1024", "--seed", "7", "--num_processes", "2", cwd=folder)
    assert restated.returncode == 0, restated.stderr[-2000:]
    expected = plan_from_dict(json.loads(restated.stdout))
    for launcher in (["accelerate", "launch", "--num_processes", "2"], ["torchrun", "--nproc_per_node", "2"]):
        result = _run("analyze", "--json", "--", *launcher, "train.py", cwd=folder)
        assert result.returncode == 0, result.stderr[-2000:]
        plan = plan_from_dict(json.loads(result.stdout))
        assert (plan.pad_to_multiple_of, plan.config["num_processes"]) == (128, 2)
        assert plan.shapes == expected.shapes


SCRIPTS = {
    # (script body after HEAD, exit code, what the one line says)
    "exits": ("sys.exit(3)\n", 1, "train.py exited (exit code 3) before building a TRL trainer"),
    "exits with a message": ("sys.exit('no GPU here')\n", 1, "train.py exited: no GPU here before building"),
    "raises": ("rows = load_dataset('json', data_files=DATA, split='train')\nrows['missing']\n", 1,
               "train.py failed before building its trainer: ValueError: Column 'missing'"),
    "builds no trainer": ("print('done')\n", 1, "train.py finished without building a TRL trainer"),
    "a Trainer shapeplan does not plan": (
        "from transformers import Trainer, TrainingArguments\n"
        "Trainer(model=None, args=TrainingArguments('out', use_cpu=True)).train()\n", 2,
        "trains Trainer (train.py:8), which shapeplan does not plan"),
    "its own collator": (
        "rows = load_dataset('json', data_files=DATA, split='train')\n"
        "SFTTrainer(model=MODEL, train_dataset=rows, data_collator=lambda rows: rows).train()\n", 2,
        "is given its own data_collator (function), whose batch shapes shapeplan cannot replay"),
    "eval without data": (
        "rows = load_dataset('json', data_files=DATA, split='train')\n"
        "config = SFTConfig('out', eval_strategy='steps', eval_steps=5)\n"
        "SFTTrainer(model=MODEL, args=config, train_dataset=rows).train()\n", 2, "is given no eval_dataset"),
}


def test_each_way_a_script_goes_wrong_is_one_line(tmp_path: Path) -> None:
    """A script that exits, raises, builds no trainer or one shapeplan does not plan, or hands the trainer what
    planning cannot replay: one line naming the script (and line), a documented exit code, no traceback."""
    for name, (body, code, said) in SCRIPTS.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        _files(folder, HEAD + body)
        result = _run("analyze", "--", "python", "train.py", cwd=folder)
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
        assert (result.returncode, len(errors)) == (code, 1), (name, result.stderr[-1500:])
        assert said in result.stderr and "Traceback" not in result.stderr, (name, result.stderr[-1500:])
        if name == "raises":
            assert "(train.py:8)" in result.stderr
    folder = _files(tmp_path, HEAD)
    for args, said in ((["--model", TINY_MODEL], "--model is given with a training script"),
                       (["--method", "grpo"], "--method is given with a training script"),
                       ([], "training script missing.py not found")):
        result = _run("analyze", *args, "--", "python", "missing.py" if not args else "train.py", cwd=folder)
        assert (result.returncode, said in result.stderr) == (2, True), result.stderr[-1500:]
    result = _run("advise", "--", "python", "train.py", cwd=folder)  # advise runs scripts alike
    assert result.returncode == 1 and "train.py finished without building a TRL trainer" in result.stderr


def test_the_trainer_planned_is_the_one_the_script_trains_first(tmp_path: Path) -> None:
    """A script that builds two trainers and trains the second first: the second is planned, and the plan says
    which (class and line); a subclass of the script's own is planned as its TRL trainer. In-process through the
    Python API, which leaves TRL's classes as they were."""
    from trl import SFTTrainer

    import shapeplan

    script = HEAD + """rows = load_dataset("json", data_files=DATA, split="train")


class MyTrainer(SFTTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.note = "mine"


first = SFTTrainer(model=MODEL, args=SFTConfig("out", max_length=256, use_cpu=True), train_dataset=rows)
second = MyTrainer(model=MODEL, args=SFTConfig("out", max_length=512, use_cpu=True), train_dataset=rows)
second.train()
first.train()
"""
    folder = _files(tmp_path, script)
    init = SFTTrainer.__init__
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        plan = shapeplan.analyze_script(["python", "train.py"])
    finally:
        os.chdir(cwd)
    assert plan.config["trainer"] == "MyTrainer(SFTTrainer) (train.py:17)"
    assert plan.config["max_length"] == 512 and max(s.seq for s in plan.shapes) == 512
    assert SFTTrainer.__init__ is init and "__getattr__" not in vars(SFTTrainer.__mro__[-2])


def test_a_vision_script_and_a_rollout_script_plan_as_restated(tmp_path: Path) -> None:
    """A vision-language SFT script plans as the same run restated as options (its images read from their headers,
    the processor's settings from the model); a GRPO script whose rollout function reads what a real trainer has
    (`trainer.model_wrapped`, `trainer.accelerator`, through TRL's `unwrap_model_for_generation`) and generates
    through `trainer._generate_single_turn` is planned (before, its dry run failed on `model_wrapped`)."""
    from tests.conftest import TINY_VL_MODEL
    from tests.oracle.vision_data import write_images, write_rows

    data = write_rows(tmp_path / "train.jsonl", write_images(tmp_path / "images"), 6, seed=3)
    options = ["--per_device_train_batch_size", "2", "--max_steps", "3", "--max_length", "512"]
    restated = _run("analyze", "--json", data, "--model", TINY_VL_MODEL, *options, cwd=tmp_path)
    assert restated.returncode == 0, restated.stderr[-2000:]
    vision = f"""import sys
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer

rows = load_dataset("json", data_files={str(data)!r}, split="train")
config = SFTConfig("out", per_device_train_batch_size=2, max_steps=3, max_length=512)
SFTTrainer(model={str(TINY_VL_MODEL)!r}, args=config, train_dataset=rows).train()
"""
    (tmp_path / "vision.py").write_text(vision, encoding="utf-8")
    result = _run("analyze", "--json", "--", "python", "vision.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    planned = plan_from_dict(json.loads(result.stdout))
    assert planned.shapes == plan_from_dict(json.loads(restated.stdout)).shapes
    assert any(s.pixel_values for s in planned.shapes)

    # a processor the script loads with settings of its own (Gemma 3's pan-and-scan, which the processor's call
    # settings decide) plans as the model whose files hold them
    from tests.oracle.vision_families import write_gemma3

    plain, scanning = write_gemma3(tmp_path / "gemma3"), write_gemma3(tmp_path / "gemma3-scan", pan_and_scan=True)
    restated = _run("analyze", "--json", data, "--model", scanning, *options, cwd=tmp_path)
    assert restated.returncode == 0, restated.stderr[-2000:]
    (tmp_path / "gemma.py").write_text(vision.replace("SFTTrainer(model=", f"""from transformers import AutoProcessor

processor = AutoProcessor.from_pretrained({str(plain)!r}, do_pan_and_scan=True, pan_and_scan_min_crop_size=32,
                                          pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)
SFTTrainer(processing_class=processor, model=""").replace(repr(str(TINY_VL_MODEL)), repr(str(plain))),
                                         encoding="utf-8")
    result = _run("analyze", "--json", "--", "python", "gemma.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    crops = {key for s in plan_from_dict(json.loads(result.stdout)).shapes for key in s.images}
    assert plan_from_dict(json.loads(result.stdout)).shapes == plan_from_dict(json.loads(restated.stdout)).shapes
    assert any(key and key[0] > 0 for key in crops), crops

    rollout = f"""from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import unwrap_model_for_generation


def rollout(prompts, trainer):
    tokenizer = trainer.processing_class
    ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
           for p in prompts]
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator):
        completions, _ = trainer._generate_single_turn(ids, None, {{}}, 1)
    return {{"prompt_ids": ids, "completion_ids": completions, "logprobs": None}}


rows = Dataset.from_list([{{"prompt": [{{"role": "user", "content": "Say " + "yes " * i}}]}} for i in range(8)])
config = GRPOConfig("out", per_device_train_batch_size=4, num_generations=4, max_completion_length=64,
                    max_steps=2, cache_implementation="static")
GRPOTrainer(model={str(TINY_MODEL)!r}, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
            train_dataset=rows, rollout_func=rollout).train()
"""
    (tmp_path / "rollout.py").write_text(rollout, encoding="utf-8")
    result = _run("analyze", "--json", "--", "python", "rollout.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    planned = plan_from_dict(json.loads(result.stdout))
    assert planned.config["rollout_func"] == "__main__:rollout"
    assert {s.phase for s in planned.shapes} >= {"generate", "train"}


def test_advise_weighs_a_script_as_the_same_run_restated(tmp_path: Path) -> None:
    """`advise -- python train.py`: each what-if is the script's config with the options changed (its derived
    values built again), planned on the script's data: the same alternatives, shapes and recommendation as the run
    restated as options, and the change said as what to set in the script."""
    script = HEAD + """rows = load_dataset("json", data_files=DATA, split="train")
config = SFTConfig(output_dir="out", per_device_train_batch_size=4, max_length=1024, seed=7)
SFTTrainer(model=MODEL, args=config, train_dataset=rows).train()
"""
    folder = _files(tmp_path, script)
    restated = _run("advise", "--json", CAPYBARA, "--model", TINY_MODEL, "--per_device_train_batch_size", "4",
                    "--max_length", "1024", "--seed", "7", cwd=folder)
    scripted = _run("advise", "--json", "--", "python", "train.py", cwd=folder)
    assert (restated.returncode, scripted.returncode) == (0, 0), scripted.stderr[-2000:]
    expected, advice = json.loads(restated.stdout), json.loads(scripted.stdout)

    def weighed(report: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [(o["option"], o["shapes"], o["data_lost"]) for o in report["alternatives"]]

    assert weighed(advice) == weighed(expected) and advice["recommended"] == expected["recommended"]
    assert advice["recommended_command"] == ["python", "train.py"]
    assert advice["notes"][0].startswith("set in the script's config: ")
