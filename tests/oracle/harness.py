"""The shape oracle: a real TRL trainer run on CPU with the bundled tiny model, recording every input shape
the model receives, by phase and step. Plans are checked against this, never against the notes."""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import TINY_MODEL


@dataclass(frozen=True)
class Seen:
    phase: str
    batch: int
    seq: int
    step: int  # train: the optimizer step being computed (1-based); eval: global_step when it ran


def _parse(method: str, argv: Sequence[str]):  # type: ignore[no-untyped-def]
    module = importlib.import_module(f"trl.scripts.{method}")
    parser = module.make_parser()
    return parser.parse_args_and_config(list(argv), return_remaining_strings=True)[:-1]


def run_sft(train_path: Path, argv: Sequence[str], *, eval_path: Path | None = None) -> list[Seen]:
    """Train with `trl sft`'s parser on `argv` (TRL options), recording what the model is fed."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    script, config, *_ = _parse("sft", [
        "--output_dir", "/tmp/shapeplan-oracle", "--report_to", "none", "--use_cpu", "true",
        "--save_strategy", "no", "--logging_steps", "1000", "--bf16", "false", "--disable_tqdm", "true", *argv])
    train = load_dataset("json", data_files=str(train_path), split="train")
    eval_ds = load_dataset("json", data_files=str(eval_path), split="train") if eval_path else None
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype="float32")
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, eval_dataset=eval_ds,
                         processing_class=tokenizer)
    seen: list[Seen] = []

    def hook(module, args, kwargs):  # type: ignore[no-untyped-def]
        ids = kwargs.get("input_ids", args[0] if args else None)
        phase = "train" if module.training else "eval"
        step = trainer.state.global_step + (1 if phase == "train" else 0)
        seen.append(Seen(phase, int(ids.shape[0]), int(ids.shape[1]), step))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    trainer.train()
    return seen


def observed(seen: Sequence[Seen]) -> dict[tuple[str, int, int], tuple[int, int]]:
    """(phase, batch, seq) -> (count, first step)."""
    counts = Counter((s.phase, s.batch, s.seq) for s in seen)
    first: dict[tuple[str, int, int], int] = {}
    for s in seen:
        first.setdefault((s.phase, s.batch, s.seq), s.step)
    return {k: (counts[k], first[k]) for k in counts}


def planned(plan) -> dict[tuple[str, int, int], tuple[int, int]]:  # type: ignore[no-untyped-def]
    return {(s.phase, s.batch, s.seq): (s.count, s.first_step) for s in plan.shapes}
