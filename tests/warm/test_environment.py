"""The warm environment, the manifest key: one definition for every warmer, and its value unchanged, so that caches
warmed by earlier shapeplan versions still match."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shapeplan.adapters.trl_args import parse_training_args
from shapeplan.services.trainers import TRAINERS
from tests.conftest import ROOT
from tests.warm.harness import LORA

RUN = ["--model_name_or_path", "org/model", "--bf16", "false"]
# method -> (TRL options, the config hash shapeplan wrote into manifests before the warmers shared one environment
# function: measured with commit 11439ab, trl 1.16). A change here splits every existing cache dir.
WRITTEN = {
    "sft": (["--packing", "--gradient_checkpointing", "false"], "7b6d4fba6452b9f6"),
    "grpo": (["--reward_funcs", "x"], "b08ae6fd9a831c86"),
    "dpo": (["--beta", "0.2"], "1fe051cda955bd8b"),
    "distillation": (["--teacher_model_name_or_path", "org/teacher"], "d4b20b0a35012ade"),
}


@pytest.mark.parametrize("method", sorted(WRITTEN))
def test_the_environment_of_a_run_is_what_earlier_versions_wrote(method: str) -> None:
    argv, config_hash = WRITTEN[method]
    environment = TRAINERS[method].warmer(parse_training_args(TRAINERS[method], [*RUN, *argv])).environment()
    assert set(environment.pop("versions")) == {"torch", "trl", "transformers", "accelerate"}
    assert environment == {"method": method, "model": "org/model", "world_size": 1, "config_hash": config_hash,
                           "dtype": {"model": "float32", "bf16": False, "fp16": False}}


def test_only_options_that_change_the_compiled_code_change_the_hash() -> None:
    def config_hash(*argv: str) -> str:
        args = parse_training_args(TRAINERS["sft"], [*RUN, *argv])
        return str(TRAINERS["sft"].warmer(args).environment()["config_hash"])

    base = config_hash()
    assert config_hash("--learning_rate", "0.5", "--output_dir", "elsewhere", "--logging_steps", "3") == base
    assert config_hash("--gradient_checkpointing", "false") != base


def test_a_peft_run_records_its_adapter_settings() -> None:
    def environment(*argv: str) -> dict:  # type: ignore[type-arg]
        return TRAINERS["sft"].warmer(parse_training_args(TRAINERS["sft"], [*RUN, *argv])).environment()

    lora = environment(*LORA)
    assert lora["peft"] == {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": "all-linear",
                            "target_parameters": None, "modules_to_save": None, "task_type": "CAUSAL_LM",
                            "use_rslora": False, "use_dora": False}
    assert "peft" not in environment()  # a full fine-tune's environment is what it was
    assert environment(*LORA, "--lora_alpha", "32")["peft"]["alpha"] == 32


def test_round_planning_imports_no_torch() -> None:
    code = ("import sys, shapeplan.warm.rounds\n"
            "print(sorted(n for n in ('torch', 'trl', 'transformers', 'datasets') if n in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "[]\n"), result.stderr
