"""The pure planning core: batch shapes against TRL's real collator, the bound for unreplayable orders, and the
plan file (round trip, atomic write)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from pathlib import Path

import pytest

from shapeplan.errors import PlanFileError
from shapeplan.plan import io
from shapeplan.plan.model import Plan, PlanStats, Shape
from shapeplan.plan.rows import Rows, padded_batch, padding_free_batch, reachable_seqs

# (documents of each row in the batch, pad_to_multiple_of)
PADDING_FREE_CASES = {
    "rows-no-padding-needed": ([[5], [3]], 8),
    "rows-padded": ([[5], [4]], 8),
    "packed-documents-padded": ([[3, 2, 4], [7], [1, 1]], 16),
    "packed-documents-unpadded": ([[3, 2, 4], [7]], None),
    "one-document-unpadded": ([[16]], 8),
    "one-pad-token": ([[6, 1]], 8),
    "pad-longer-than-documents": ([[2], [1]], 128),
}


@pytest.mark.parametrize("name", sorted(PADDING_FREE_CASES))
def test_padding_free_batch_equals_trl_collator(name: str) -> None:
    """(1, seq), len(cu_seq_lens_q) and max_length_q as `DataCollatorForLanguageModeling(padding_free=True)` gives."""
    from transformers.masking_utils import find_packed_sequence_indices
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    documents, multiple = PADDING_FREE_CASES[name]
    examples = [{"input_ids": list(range(1, sum(docs) + 1)), "seq_lengths": docs} for docs in documents]
    out = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=multiple)(examples)
    rows = Rows(lengths=tuple(sum(d) for d in documents), documents=tuple(tuple(d) for d in documents))
    shape = padding_free_batch(rows, range(len(documents)), multiple)
    assert (shape.batch, shape.seq, shape.cu_seq_lens, shape.max_length_q) == (
        *out["input_ids"].shape, out["cu_seq_lens_q"].numel(), out["max_length_q"])
    assert shape.tokens == sum(map(sum, documents))
    # transformers builds no mask when the position ids run as one sequence (and so takes SDPA's is_causal path)
    assert shape.unpadded == (find_packed_sequence_indices(out["position_ids"]) is None)


def test_padded_batch_equals_trl_collator() -> None:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    lengths = (5, 17, 9)
    out = DataCollatorForLanguageModeling(pad_token_id=0, pad_to_multiple_of=8)(
        [{"input_ids": list(range(1, n + 1))} for n in lengths])
    shape = padded_batch(Rows(lengths=lengths), [0, 1, 2], 8)
    assert (shape.batch, shape.seq, shape.tokens) == (*out["input_ids"].shape, int(out["attention_mask"].sum()))
    assert not shape.unpadded


def test_unpadded_batch_equals_trl_collator() -> None:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    lengths = (8, 16, 16)
    for batch in ([0], [1, 2], [0, 1]):
        out = DataCollatorForLanguageModeling(pad_token_id=0, pad_to_multiple_of=8)(
            [{"input_ids": list(range(1, lengths[i] + 1))} for i in batch])
        assert padded_batch(Rows(lengths=lengths), batch, 8).unpadded == bool(out["attention_mask"].all())


@pytest.mark.parametrize("size", [1, 2, 3, 6])
@pytest.mark.parametrize("multiple", [None, 4])
def test_reachable_seqs_padded_is_every_order(size: int, multiple: int | None) -> None:
    """Padded: exactly the shapes some choice of `size` distinct rows gives."""
    rows = Rows(lengths=(3, 9, 4, 9, 1, 6))
    every = {padded_batch(rows, batch, multiple).seq for batch in itertools.combinations(range(6), size)}
    assert set(reachable_seqs(rows, size, multiple, padding_free=False)) == every


@pytest.mark.parametrize("size", [1, 2, 4])
def test_reachable_seqs_padding_free_covers_every_order(size: int) -> None:
    """Padding-free: every total some choice of rows gives lies in the bound, whose ends are met."""
    rows = Rows(lengths=(3, 9, 4, 9, 1, 6))
    every = {padding_free_batch(rows, batch, 4).seq for batch in itertools.combinations(range(6), size)}
    bound = reachable_seqs(rows, size, 4, padding_free=True)
    assert every <= set(bound) and {bound[0], bound[-1]} <= every
    assert all(seq % 4 == 0 for seq in bound)


def test_reachable_seqs_batch_larger_than_dataset_repeats_rows() -> None:
    rows = Rows(lengths=(3, 7))
    assert reachable_seqs(rows, 3, None, padding_free=False) == (3, 7)
    assert reachable_seqs(rows, 3, None, padding_free=True) == tuple(range(9, 22))


def _plan() -> Plan:
    return Plan(
        method="sft", exact=False, pad_to_multiple_of=128,
        shapes=(Shape("train", 1, 256, count=3, first_step=1, max_count=5, cu_seq_lens=(4, 9), max_length_q=(97, 128),
                      varlen_pairs=((4, 97), (9, 97), (9, 128))),
                Shape("train", 4, 128, count=2, first_step=2, certain=False),
                Shape("eval", 8, 384, count=5, first_step=0, unpadded=2)),
        stats=PlanStats(rows=10, dropped_rows=2, micro_batches=5, optimizer_steps=3, tokens=700, padded_tokens=1280,
                        evaluations=5, eval_rows=40),
        config={"argv": ["--packing"], "num_processes": 2, "max_length": 256, "num_train_epochs": 1.5},
        versions={"trl": "1.16.0"}, fingerprint={"tokenizer": "abc"}, warnings=("a bound",),
    )


def test_plan_round_trips_through_json(tmp_path: Path) -> None:
    plan = _plan()
    assert io.plan_from_dict(json.loads(io.dumps(plan))) == plan
    io.write_plan(plan, tmp_path / "plan.json")
    assert io.load_plan(tmp_path / "plan.json") == plan


def test_plan_json_leaves_unset_optional_fields_out() -> None:
    shapes = json.loads(io.dumps(_plan()))["shapes"]
    assert shapes[1] == {"phase": "train", "batch": 4, "seq": 128, "count": 2, "first_step": 2, "certain": False}
    assert shapes[0]["cu_seq_lens"] == [4, 9] and shapes[0]["max_length_q"] == [97, 128]
    assert shapes[0]["varlen_pairs"] == [[4, 97], [9, 97], [9, 128]] and "unpadded" not in shapes[0]
    assert shapes[2]["unpadded"] == 2


def test_plan_json_without_later_fields_reads_with_their_defaults() -> None:
    """A plan written before `varlen_pairs`, `unpadded` and the eval stats existed still loads."""
    data = json.loads(io.dumps(_plan()))
    for shape in data["shapes"]:
        shape.pop("varlen_pairs", None)
        shape.pop("unpadded", None)
    del data["stats"]["evaluations"], data["stats"]["eval_rows"]
    plan = _plan()
    assert io.plan_from_dict(data) == dataclasses.replace(
        plan, shapes=tuple(dataclasses.replace(s, varlen_pairs=(), unpadded=0) for s in plan.shapes),
        stats=dataclasses.replace(plan.stats, evaluations=0, eval_rows=0))


def test_failed_atomic_write_keeps_the_old_file_and_leaves_no_partial_one(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "plan.json"
    target.write_text("old")

    def fail(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(PlanFileError, match="No space left on device"):
        io.write_plan(_plan(), target)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_failed_atomic_write_creates_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(src: str, dst: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(KeyboardInterrupt):
        io.write_atomic(tmp_path / "plan.json", "text")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ('{"schema": 2}', "schema 2"),
    ('{"schema": 1, "shapes": []}', "malformed plan"),
])
def test_load_plan_rejects_bad_files(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(PlanFileError, match=message):
        io.load_plan(tmp_path / "plan.json")



def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def test_atomic_write_uses_the_umask_and_removes_temporaries_of_dead_writers(tmp_path: Path) -> None:
    """A writer killed with kill -9 leaves `.plan.json.<pid>.*.tmp`; the next write of plan.json removes it, and
    leaves a live writer's alone. The file gets the umask's mode (0644 under 022), not mkstemp's 0600."""
    stale = tmp_path / f".plan.json.{dead_pid()}.k9x2ab.tmp"
    live = tmp_path / f".plan.json.{os.getpid()}.a1b2c3.tmp"
    other = tmp_path / f".other.json.{dead_pid()}.k9x2ab.tmp"
    for path in (stale, live, other):
        path.write_text("partial")
    previous = os.umask(0o022)
    try:
        io.write_plan(_plan(), tmp_path / "plan.json")
    finally:
        os.umask(previous)
    assert (tmp_path / "plan.json").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["plan.json", live.name, other.name])


@pytest.mark.parametrize("shape, field, value", [
    ({"seq": 200}, "shapes[0].seq", 200), ({"batch": 0}, "shapes[0].batch", 0),
    ({"count": 1.5}, "shapes[0].count", 1.5), ({"max_count": 2}, "shapes[0].max_count", 2),
    ({"seq": 1 << 30}, "shapes[0].seq", 1 << 30), ({"first_step": -1}, "shapes[0].first_step", -1),
])
def test_plan_values_are_checked_and_the_error_carries_them(shape: dict, field: str, value: object) -> None:
    data = json.loads(io.dumps(_plan()))
    data["shapes"][0].update(shape)
    with pytest.raises(PlanFileError) as error:
        io.plan_from_dict(data)
    assert (error.value.field, error.value.value) == (field, value)  # type: ignore[attr-defined]  # from **values
    assert str(error.value).startswith(f"malformed plan: {field} ")


@pytest.mark.parametrize("text, message", [
    ('{"schema": 1, "schema": 1}', "duplicate key 'schema'"),
    ('{"schema": 1, "x": NaN}', "NaN is not a JSON number"),
    ('{"schema": 1, "x": ' + "9" * 5000 + "}", "digits"),
])
def test_load_plan_is_strict_json(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(PlanFileError, match=message):
        io.load_plan(tmp_path / "plan.json")
