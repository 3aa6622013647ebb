"""The shape oracle: a real TRL trainer run on CPU with the bundled tiny model, recording every input shape
the model receives, by phase and step. Plans are checked against this, never against the notes.

`run_sft` trains in this process; `run_sft_distributed` runs the same function in N processes joined by gloo
(as `accelerate launch --num_processes N --cpu` would) and returns what every rank recorded.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.conftest import ROOT, TINY_MODEL


@dataclass(frozen=True)
class Seen:
    phase: str
    batch: int
    seq: int
    step: int  # train: the optimizer step being computed (1-based); eval: global_step when it ran
    cu_seq_lens: int | None = None  # padding-free: len(cu_seq_lens_q) the model received
    max_length_q: int | None = None  # padding-free: the max_length_q kwarg the model received
    rank: int = 0


def _parse(method: str, argv: Sequence[str]):  # type: ignore[no-untyped-def]
    module = importlib.import_module(f"trl.scripts.{method}")
    parser = module.make_parser()
    return parser.parse_args_and_config(list(argv), return_remaining_strings=True)[:-1]


def run_sft(train_path: Path, argv: Sequence[str], *, eval_path: Path | None = None) -> list[Seen]:
    """Train with `trl sft`'s parser on `argv` (TRL options), recording what the model is fed."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    torch.set_num_threads(1)  # the tiny model gains nothing from threads; they only contend on a shared machine

    script, config, *_ = _parse("sft", [
        "--output_dir", "/tmp/shapeplan-oracle", "--report_to", "none", "--use_cpu", "true",
        "--save_strategy", "no", "--logging_steps", "1000", "--bf16", "false", "--disable_tqdm", "true", *argv])
    train = load_dataset("json", data_files=str(train_path), split="train")
    eval_ds = load_dataset("json", data_files=str(eval_path), split="train") if eval_path else None
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype="float32")
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, eval_dataset=eval_ds,
                         processing_class=tokenizer)
    rank = trainer.args.process_index
    seen: list[Seen] = []

    def hook(module, args, kwargs):  # type: ignore[no-untyped-def]
        ids = kwargs.get("input_ids", args[0] if args else None)
        phase = "train" if module.training else "eval"
        step = trainer.state.global_step + (1 if phase == "train" else 0)
        cu = kwargs.get("cu_seq_lens_q")
        max_q = kwargs.get("max_length_q")
        seen.append(Seen(phase, int(ids.shape[0]), int(ids.shape[1]), step,
                         cu_seq_lens=None if cu is None else int(cu.numel()),
                         max_length_q=None if max_q is None else int(max_q), rank=rank))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    trainer.train()
    return seen


def run_sft_distributed(train_path: Path, argv: Sequence[str], *, eval_path: Path | None = None,
                        num_processes: int = 2, tmp_dir: Path, timeout_s: float = 600) -> list[Seen]:
    """`run_sft` in `num_processes` CPU processes joined by gloo; what every rank recorded, concatenated."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(num_processes):
        out = tmp_dir / f"rank{rank}.json"
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_processes),
               "LOCAL_WORLD_SIZE": str(num_processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        spec = json.dumps({"train": str(train_path), "argv": list(argv),
                           "eval": str(eval_path) if eval_path else None, "out": str(out)})
        with open(tmp_dir / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.oracle.harness", spec], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    # A rank that fails leaves the others waiting in a collective: stop them rather than wait for gloo's timeout.
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.2)
    for rank, p in enumerate(procs):
        if p.returncode != 0:
            log_text = (tmp_dir / f"rank{rank}.log").read_text()
            raise RuntimeError(f"oracle rank {rank} exited with {p.returncode}:\n{log_text[-4000:]}")
    seen: list[Seen] = []
    for rank in range(num_processes):
        seen += [Seen(**s) for s in json.loads((tmp_dir / f"rank{rank}.json").read_text())]
    return seen


def observed(seen: Sequence[Seen], *, varlen: bool = False) -> dict[tuple[str, int, int], tuple]:
    """(phase, batch, seq) -> (count, first step), plus the sorted cu_seq_lens lengths and max_length_q values
    met with that shape when `varlen`."""
    counts = Counter((s.phase, s.batch, s.seq) for s in seen)
    first: dict[tuple[str, int, int], int] = {}
    cu: dict[tuple[str, int, int], set[int]] = {}
    max_q: dict[tuple[str, int, int], set[int]] = {}
    for s in seen:
        key = (s.phase, s.batch, s.seq)
        first[key] = min(first.get(key, s.step), s.step)
        cu.setdefault(key, set())
        max_q.setdefault(key, set())
        if s.cu_seq_lens is not None:
            cu[key].add(s.cu_seq_lens)
            max_q[key].add(s.max_length_q)  # type: ignore[arg-type]
    if not varlen:
        return {k: (counts[k], first[k]) for k in counts}
    return {k: (counts[k], first[k], tuple(sorted(cu[k])), tuple(sorted(max_q[k]))) for k in counts}


def planned(plan, *, varlen: bool = False) -> dict[tuple[str, int, int], tuple]:  # type: ignore[no-untyped-def]
    if not varlen:
        return {(s.phase, s.batch, s.seq): (s.count, s.first_step) for s in plan.shapes}
    return {(s.phase, s.batch, s.seq): (s.count, s.first_step, s.cu_seq_lens, s.max_length_q) for s in plan.shapes}


def _rank_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    seen = run_sft(Path(spec["train"]), spec["argv"], eval_path=Path(spec["eval"]) if spec["eval"] else None)
    Path(spec["out"]).write_text(json.dumps([asdict(s) for s in seen]))


if __name__ == "__main__":  # one rank of run_sft_distributed; importing tests.conftest set the offline env
    _rank_main(sys.argv[1])
