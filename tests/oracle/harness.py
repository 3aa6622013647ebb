"""The shape oracle: a real TRL trainer run on CPU with the bundled tiny model, recording every input shape
the model receives, by phase and step, through the guard's recorder (`ShapeGuard(on_unplanned="record")`), whose
phase rules are the library's. Plans are checked against this, never against the notes.

`run_sft` trains in this process; `run_distributed` runs it (or `preference_harness.run_preference` for DPO, KTO and
Reward) in N processes joined by gloo (as `accelerate launch --num_processes N --cpu` would) and returns what every
rank recorded.
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
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from shapeplan.guard.recorder import Forward
from tests import console
from tests.conftest import ROOT, TINY_MODEL


def _parse(method: str, argv: Sequence[str]):  # type: ignore[no-untyped-def]
    module = importlib.import_module(f"trl.scripts.{method}")
    parser = module.make_parser()
    return parser.parse_args_and_config(list(argv), return_remaining_strings=True)[:-1]


def run_sft(train_path: Path, argv: Sequence[str], *, eval_path: Path | None = None,
            streaming: bool = False, guard: Any = None) -> list[Forward]:
    """Train with `trl sft`'s parser on `argv` (TRL options), recording what the model is fed. `streaming` loads the
    data files as `trl sft --dataset_streaming` does: `load_dataset(..., streaming=True)`, an IterableDataset."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    from shapeplan import ShapeGuard

    torch.set_num_threads(1)  # the tiny model gains nothing from threads; they only contend on a shared machine

    _, config, *_ = _parse("sft", [
        "--output_dir", "/tmp/shapeplan-oracle", "--report_to", "none", "--use_cpu", "true",
        "--save_strategy", "no", "--logging_steps", "1000", "--bf16", "false", "--disable_tqdm", "true", *argv])
    train = load_data(train_path, streaming)
    eval_ds = load_data(eval_path, streaming) if eval_path else None
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype="float32")
    seen: list[Forward] = []
    guard = guard or ShapeGuard(on_unplanned="record")  # a test's own guard checks the run against a plan
    guard.on_forward = seen.append
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, eval_dataset=eval_ds,
                         processing_class=tokenizer, callbacks=[guard])
    trainer.train()
    return seen


def load_data(path: Path, streaming: bool, cache_dir: Path | None = None):  # type: ignore[no-untyped-def]
    """A JSONL file, or a folder of them (one shard per file when streamed), as `trl <method>` loads it (with
    --dataset_streaming: `load_dataset(..., streaming=True)`, an IterableDataset), into `cache_dir` (None: the
    default datasets cache)."""
    from datasets import load_dataset

    cache = str(cache_dir) if cache_dir is not None else None
    if path.is_dir():
        return load_dataset(str(path), split="train", streaming=streaming, cache_dir=cache)
    return load_dataset("json", data_files=str(path), split="train", streaming=streaming, cache_dir=cache)


def run_distributed(train_path: Path, argv: Sequence[str], *, method: str = "sft", eval_path: Path | None = None,
                    num_processes: int = 2, tmp_dir: Path, timeout_s: float = 600,
                    streaming: bool = False) -> list[Forward]:
    """`method`'s oracle run (SFT, DPO, KTO, Reward) in `num_processes` CPU processes joined by gloo; what every
    rank recorded, concatenated."""
    spec = {"method": method, "train": str(train_path), "argv": list(argv), "streaming": streaming,
            "eval": str(eval_path) if eval_path else None}
    return run_ranks("tests.oracle.harness", spec, num_processes=num_processes, tmp_dir=tmp_dir, timeout_s=timeout_s)


def run_ranks(module: str, spec: dict[str, Any], *, num_processes: int, tmp_dir: Path,
              timeout_s: float = 600) -> list[Forward]:
    """`python -m module SPEC` in `num_processes` CPU processes joined by gloo (as `accelerate launch
    --num_processes N --cpu` would); each writes what its rank recorded to `SPEC["out"]`, a JSON list of `Forward`s.
    Returns every rank's, concatenated."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(num_processes):
        out = tmp_dir / f"rank{rank}.json"
        python, env = console.forked_python({
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(num_processes),
            "LOCAL_WORLD_SIZE": str(num_processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        with open(tmp_dir / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([*python, "-m", module, json.dumps({**spec, "out": str(out)})],
                                          cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
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
    seen: list[Forward] = []
    for rank in range(num_processes):
        seen += [Forward(**s) for s in json.loads((tmp_dir / f"rank{rank}.json").read_text())]
    return seen


def end_rank(code: int = 0) -> NoReturn:
    """End a rank process once its record is written, skipping the interpreter's teardown: tearing down torch's
    gloo threads at exit now and then aborts ("terminate called without an active exception", exit -6) after the
    rank has finished, in real TRL runs as much as in warm-ups, which would fail a run that did what it should."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def observed(seen: Sequence[Forward], *, varlen: bool = False, unpadded: bool = False) -> dict[
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
    train, eval_path = Path(spec["train"]), Path(spec["eval"]) if spec["eval"] else None
    if spec["method"] == "sft":
        seen = run_sft(train, spec["argv"], eval_path=eval_path, streaming=spec["streaming"])
    else:
        from tests.oracle.preference_harness import run_preference

        seen = run_preference(spec["method"], train, spec["argv"], eval_path=eval_path,
                              streaming=spec["streaming"]).seen
    Path(spec["out"]).write_text(json.dumps([asdict(s) for s in seen]))


if __name__ == "__main__":  # one rank of run_distributed; importing tests.conftest set the offline env
    _rank_main(sys.argv[1])
    end_rank()
