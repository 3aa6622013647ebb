"""A user's agentic GRPO script under torch.compile (Inductor), taken as it is: it builds its data with
`Dataset.from_list(...).map(...)`, defines its tool and its config in the script and imports its reward from a
module beside it. `shapeplan analyze -o PLAN -- python train.py` plans the trainer the script builds (tool turns
padded to the round's rows and the static cache pinned at the longest length a call needs, the defaults),
`shapeplan warm --plan PLAN` re-runs the script for its objects and compiles the plan, and the command warm prints
(`shapeplan guard --plan PLAN -- python train.py`), run as printed, compiles nothing. The tool sends every other row
out of the loop, so unpadded the run would generate a turn on one row of two, and unpinned a turn's cache would grow
past the first call's: graphs the warm-up never made; the guard pads and pins it."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from shapeplan.plan.io import load_plan
from tests import console
from tests.conftest import ROOT, TINY_MODEL

pytestmark = pytest.mark.slow

SCRIPT = """import itertools
import json

from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from my_rewards import reward_len  # a module beside the script, as `python train.py` imports it
from tests.oracle.agentic_tools import forced_call

MODEL = {model!r}
_tickets = itertools.count()


def ticket() -> str:
    '''Open a support ticket.'''
    # every other call answers at length: those rows leave the tool loop, so a turn generates on some rows
    return "opened" if next(_tickets) % 2 == 0 else "queued " * 100


def main():
    rows = Dataset.from_list([{{"id": i}} for i in range(4)])
    rows = rows.map(lambda row: {{"prompt": [{{"role": "user", "content": f"Ticket {{row['id']}}."}}]}},
                    remove_columns=["id"])
    generation = json.loads(forced_call(AutoTokenizer.from_pretrained(MODEL), "ticket", {{}}))
    config = GRPOConfig(output_dir="out", per_device_train_batch_size=2, num_generations=2, max_completion_length=200,
                        max_tool_calling_iterations=2, max_steps=2, cache_implementation="static", bf16=False,
                        use_cpu=True, pad_to_multiple_of=256, torch_compile=True, generation_kwargs=generation,
                        report_to="none", save_strategy="no", disable_tqdm=True)
    trainer = GRPOTrainer(model=MODEL, reward_funcs=reward_len, args=config, train_dataset=rows, tools=[ticket])
    trainer.train()


if __name__ == "__main__":
    main()
"""


def test_a_guarded_agentic_script_compiles_nothing_after_the_warm_up(tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text("def reward_len(completions, **kwargs):\n"
                                            "    return [float(len(c)) for c in completions]\n", encoding="utf-8")
    (tmp_path / "train.py").write_text(SCRIPT.format(model=str(TINY_MODEL)), encoding="utf-8")
    cache, record = tmp_path / "cache", tmp_path / "run.json"
    # the repository on the path for tests.oracle only: the script's own folder is the script's business
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(cache)}

    def run(*args: str | Path) -> tuple[str, str]:
        result = console.run(args, env=env, cwd=tmp_path, timeout=1800)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout, result.stderr

    run("analyze", "-o", "plan.json", "--", "python", "train.py")
    plan = load_plan(tmp_path / "plan.json")
    assert plan.method == "grpo" and plan.config["command"] == ["python", "train.py"]
    assert plan.config["trainer"].startswith("GRPOTrainer (train.py:")
    assert plan.config["pad_tool_turns"] is True and plan.config["tools"] == ["ticket"]
    assert {s.batch for s in plan.shapes if s.phase == "generate"} == {2}
    pin = plan.config["pin_cache"]
    assert {s.cache_len for s in plan.shapes if s.phase == "generate"} == {pin}
    assert not (tmp_path / "out").exists()  # analyze never trains: nothing the run writes is left behind
    warmed, _ = run("warm", "--plan", "plan.json", "--device", "cpu", "--cache-dir", cache)
    printed = warmed.splitlines()[warmed.splitlines().index("Then train with:") + 1].strip()
    assert printed == "shapeplan guard --plan plan.json -- python train.py"
    words = shlex.split(printed)
    _, guarded = run(*words[1:4], "--record", record, *words[4:])  # as printed, plus a record to read
    summary = next(line for line in guarded.splitlines() if line.startswith("shapeplan: "))
    assert ", 0 unplanned, 0 compiles" in summary, summary
    met = load_plan(record)
    assert json.loads(record.read_text(encoding="utf-8"))["compiles"] == []
    generates = [s for s in met.shapes if s.phase == "generate"]
    assert {s.batch for s in generates} == {2} and sum(s.count for s in generates) > 2  # tool turns, padded
    assert {s.cache_len for s in generates} == {pin} and len({s.seq for s in generates}) > 1  # pinned at two buckets
