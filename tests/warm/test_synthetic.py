"""Synthetic rows collate, through TRL's own collator, into exactly the planned batch."""

from __future__ import annotations

from pathlib import Path

import pytest
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from shapeplan.warm.synthetic import (
    SyntheticBatch,
    dataset_rows,
    padded_batches,
    padded_layouts,
    padding_free_batches,
    padding_free_documents,
)
from tests.conftest import CAPYBARA
from tests.warm.harness import plan_for


def _collate(batch: SyntheticBatch, *, padding_free: bool, multiple: int | None, packed: bool = False) -> dict:
    rows, (index,) = dataset_rows([batch], vocab_size=500, seq_lengths=packed)
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=padding_free, pad_to_multiple_of=multiple)
    return collator([rows[i] for i in index])


@pytest.mark.parametrize("seq,cu,q,multiple", [
    (256, 2, 256, 128),    # one document filling the row: no padding
    (256, 5, 100, 128),    # padding tokens count as one-token documents
    (256, 257, 1, 128),    # only one-token documents
    (128, 3, 64, None),    # no padding multiple
    (384, 130, 10, 128),
])
@pytest.mark.parametrize("packed", [False, True])
def test_padding_free_batch_has_the_planned_values(seq: int, cu: int, q: int, multiple: int | None,
                                                   packed: bool) -> None:
    docs = padding_free_documents(seq, cu, q, multiple)
    assert docs is not None
    out = _collate(SyntheticBatch(docs), padding_free=True, multiple=multiple, packed=packed)
    assert tuple(out["input_ids"].shape) == (1, seq)
    assert out["cu_seq_lens_q"].numel() == cu
    assert out["max_length_q"] == q


def test_impossible_padding_free_values_are_reported() -> None:
    assert padding_free_documents(256, 600, 1, 128) is None  # more documents than tokens
    batches, problems = padding_free_batches(256, [(600, 1)], 128)
    assert batches == [] and problems == ["no padding-free batch of length 256 has len(cu_seq_lens)=600 and "
                                          "max_length_q=1"]


def test_every_planned_packing_shape_is_reproduced(tmp_path: Path) -> None:
    plan = plan_for("sft", CAPYBARA, ["--max_length", "256", "--per_device_train_batch_size", "2", "--packing",
                               "--num_train_epochs", "1"], tmp_path)
    assert plan.shapes
    for shape in plan.shapes:
        batches, problems = padding_free_batches(shape.seq, shape.varlen_pairs, 128)
        assert problems == []
        seen = []
        for b in batches:
            out = _collate(b, padding_free=True, multiple=128, packed=True)
            assert tuple(out["input_ids"].shape) == (1, shape.seq)
            seen.append((out["cu_seq_lens_q"].numel(), out["max_length_q"]))
        assert seen == list(shape.varlen_pairs)


@pytest.mark.parametrize("batch,seq,multiple,max_length,layouts", [
    (2, 256, 128, 1024, ["padded"]),
    (2, 256, 128, 256, ["padded", "unpadded"]),   # rows cut at max_length can fill the batch exactly
    (1, 128, 128, 1024, ["padded", "unpadded"]),  # one row whose length is a multiple
    (1, 77, None, 1024, ["unpadded"]),            # one row, no padding multiple: never padded
    (3, 77, None, 1024, ["padded", "unpadded"]),
])
def test_padded_layouts(batch: int, seq: int, multiple: int | None, max_length: int, layouts: list[str]) -> None:
    found = []
    for b in padded_batches(batch, seq, multiple, max_length):
        out = _collate(b, padding_free=False, multiple=multiple)
        assert tuple(out["input_ids"].shape) == (batch, seq)
        found.append("unpadded" if bool(out["attention_mask"].all()) else "padded")
    assert found == layouts


@pytest.mark.parametrize("padded,unpadded", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("batch,seq,multiple", [(2, 256, 128), (3, 77, None)])
def test_planned_padded_layouts(batch: int, seq: int, multiple: int | None, padded: bool, unpadded: bool) -> None:
    """One batch per layout the plan lists, in that order: with padding, then without."""
    found = []
    for b in padded_layouts(batch, seq, multiple, padded=padded, unpadded=unpadded):
        out = _collate(b, padding_free=False, multiple=multiple)
        assert tuple(out["input_ids"].shape) == (batch, seq)
        found.append(bool(out["attention_mask"].all()))
    assert found == [False] * padded + [True] * unpadded
