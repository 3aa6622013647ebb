"""Real `trl grpo` / `trl rloo` / `trl distillation` runs and their warm-ups on the tiny model, with the device ops
they dispatch: the harness API of tests/warm/harness.py (whose `warm_plan` serves these methods too) with the
generation options (GRPO/RLOO: a reward function; Distillation: the tiny model as its own teacher)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shapeplan.plan.model import Plan
from shapeplan.services.analyze import analyze
from shapeplan.services.trainers import TRAINERS
from shapeplan.warm.model import WarmReport
from shapeplan.warm.opsig import Signature
from tests.conftest import TINY_MODEL
from tests.warm.harness import warm_plan
from tests.warm.placement import DeviceOpRecorder, tracking

__all__ = ["PAD_MODULES", "device_ops", "plan_for", "real_run", "run_argv", "sliding_window_model", "warm_ops",
           "warm_plan"]

REWARD = "tests.oracle.grpo_harness.completion_length_reward"
BASE = ["--model_name_or_path", str(TINY_MODEL), "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true",
        "--disable_tqdm", "true", "--cache_implementation", "static"]
# what each method's run adds to BASE
SIGNAL = {"grpo": ["--reward_funcs", REWARD], "rloo": ["--reward_funcs", REWARD],
          "distillation": ["--teacher_model_name_or_path", str(TINY_MODEL)]}
# the trainer modules whose `pad` builds prompt/completion tensors on the host (tests/warm/placement.py)
PAD_MODULES = tuple(f"trl.trainer.{method}_trainer" for method in SIGNAL)


def run_argv(data: Path, argv: Sequence[str], output_dir: Path, method: str = "grpo") -> list[str]:
    return ["--dataset_name", str(data), *BASE, *SIGNAL[method], "--output_dir", str(output_dir), *argv]


def plan_for(method: str, data: Path, argv: Sequence[str], output_dir: Path) -> Plan:
    return analyze(method, run_argv(data, argv, output_dir, method))


def real_run(method: str, data: Path, argv: Sequence[str], output_dir: Path, **objects: Any) -> None:
    """`trl <method> ARGV` as its main() builds the trainer (the dataset read from a local file, streamed with
    --dataset_streaming; the eval split only when the run evaluates; no final save); `objects`: the trainer's
    arguments no command line passes (tools=, environment_factory=)."""
    import trl
    from datasets import load_dataset

    script, config, model_args, _ = importlib.import_module(TRAINERS[method].script).make_parser() \
        .parse_args_and_config(["--pad_to_multiple_of", "128", *run_argv(data, argv, output_dir, method)])
    init = dict(revision=model_args.model_revision, trust_remote_code=config.trust_remote_code,
                attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    config.model_init_kwargs = {**init, **(config.model_init_kwargs or {})}
    dataset = load_dataset("json", data_files={"train": str(data)}, streaming=script.dataset_streaming)
    if method == "distillation":  # as `trl distillation` main(): the teacher loads like the student, unquantized
        config.teacher_model_init_kwargs = {**init, "revision": config.teacher_model_revision,
                                            **(config.teacher_model_init_kwargs or {})}
        signal = {"teacher_model": config.teacher_model_name_or_path}
    else:
        module_path, name = script.reward_funcs[0].rsplit(".", 1)
        signal = {"reward_funcs": [getattr(importlib.import_module(module_path), name)]}
    trainer = TRAINERS[method].trainer()(
        model=model_args.model_name_or_path, args=config, train_dataset=dataset[script.dataset_train_split],
        eval_dataset=dataset[script.dataset_test_split] if config.eval_strategy != "no" else None,
        quantization_config=trl.get_quantization_config(model_args), peft_config=trl.get_peft_config(model_args),
        **signal, **objects)
    trainer.train()


def sliding_window_model(path: Path, window: int) -> Path:
    """The tiny model (its tokenizer, new weights) with a sliding first layer of `window` tokens and a full second
    layer, as Mistral/Qwen-style configs mark them (`layer_types`), built offline into `path`."""
    import shutil

    import torch
    from transformers import AutoConfig, Qwen3ForCausalLM

    path.mkdir(parents=True)
    for file in TINY_MODEL.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, path / file.name)
    config = AutoConfig.from_pretrained(TINY_MODEL, sliding_window=window, use_sliding_window=True, max_window_layers=0,
                                        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def device_ops(fn, *args, everything: bool = False):  # type: ignore[no-untyped-def]
    """The device-op signatures `fn(*args)` dispatches (tests/warm/placement.py tells host from device); with
    everything=True also the signatures of every op, host ones included."""
    recorder = DeviceOpRecorder()
    with tracking(recorder, *map(importlib.import_module, PAD_MODULES)):
        fn(*args)
    return (recorder.signatures, recorder.everything) if everything else recorder.signatures


def warm_ops(plan: Plan, cache_dir: Path) -> tuple[WarmReport, set[Signature]]:
    """`warm_plan(plan, cache_dir)`'s report, and the device-op signatures the warm-up dispatched."""
    reports: list[WarmReport] = []
    ops = device_ops(lambda: reports.append(warm_plan(plan, cache_dir)))
    return reports[0], ops
