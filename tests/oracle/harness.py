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
    unpadded: bool = False  # attention takes the batch as unpadded (SDPA then skips the mask)


def unpadded(kwargs: dict) -> bool:  # type: ignore[type-arg]
    """Whether transformers' mask building sees no padding in a forward's kwargs (`_preprocess_mask_arguments`):
    an attention mask of all ones, or without one, position ids that run as one sequence per row."""
    from transformers.masking_utils import find_packed_sequence_indices

    mask = kwargs.get("attention_mask")
    if mask is not None:
        return bool(mask.all())
    position_ids = kwargs.get("position_ids")
    return position_ids is None or find_packed_sequence_indices(position_ids) is None


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

    _, config, *_ = _parse("sft", [
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
                         max_length_q=None if max_q is None else int(max_q), rank=rank, unpadded=unpadded(kwargs)))

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


def observed(seen: Sequence[Seen], *, varlen: bool = False, unpadded: bool = False) -> dict[
        tuple[str, int, int], tuple]:
    """(phase, batch, seq) -> (count, first step), plus the sorted cu_seq_lens lengths, max_length_q values and
    (cu_seq_lens length, max_length_q) pairs met with that shape when `varlen`, plus how many of its batches were
    unpadded when `unpadded`."""
    counts = Counter((s.phase, s.batch, s.seq) for s in seen)
    unpadded_counts = Counter((s.phase, s.batch, s.seq) for s in seen if s.unpadded)
    first: dict[tuple[str, int, int], int] = {}
    pairs: dict[tuple[str, int, int], set[tuple[int, int]]] = {}
    for s in seen:
        key = (s.phase, s.batch, s.seq)
        first[key] = min(first.get(key, s.step), s.step)
        pairs.setdefault(key, set())
        if s.cu_seq_lens is not None:
            pairs[key].add((s.cu_seq_lens, s.max_length_q))  # type: ignore[arg-type]
    out = {}
    for k in counts:
        value: tuple = (counts[k], first[k])
        if varlen:
            value += (tuple(sorted({c for c, _ in pairs[k]})), tuple(sorted({q for _, q in pairs[k]})),
                      tuple(sorted(pairs[k])))
        if unpadded:
            value += (unpadded_counts[k],)
        out[k] = value
    return out


def planned(plan, *, varlen: bool = False, unpadded: bool = False) -> dict[  # type: ignore[no-untyped-def]
        tuple[str, int, int], tuple]:
    out = {}
    for s in plan.shapes:
        value: tuple = (s.count, s.first_step)
        if varlen:
            value += (s.cu_seq_lens, s.max_length_q, s.varlen_pairs)
        if unpadded:
            value += (s.unpadded,)
        out[(s.phase, s.batch, s.seq)] = value
    return out


def _rank_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    seen = run_sft(Path(spec["train"]), spec["argv"], eval_path=Path(spec["eval"]) if spec["eval"] else None)
    Path(spec["out"]).write_text(json.dumps([asdict(s) for s in seen]))


if __name__ == "__main__":  # one rank of run_sft_distributed; importing tests.conftest set the offline env
    _rank_main(sys.argv[1])
