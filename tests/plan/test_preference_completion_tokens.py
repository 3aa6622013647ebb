"""DPO and KTO completion-token counts (and KTO desirable rows) on hand-worked rows: the collator's cut, then
`completion_mask[..., 1:]`."""

from __future__ import annotations

from shapeplan.plan.batches import RunInfo
from shapeplan.plan.dpo import DPOLayout, plan_dpo
from shapeplan.plan.kto import KTOLayout, UnpairedRows, plan_kto
from shapeplan.plan.preference import PairedRows, completion_tokens
from shapeplan.plan.schedule import TrainLoop


def _mask_count(prompt: int, total: int, max_length: int | None, mode: str) -> int:
    """The collator's own steps on an explicit mask."""
    mask = [0] * prompt + [1] * (total - prompt)
    if max_length is not None:
        mask = mask[:max_length] if mode == "keep_start" else mask[-max_length:]
    return sum(mask[1:])


def test_completion_tokens_equal_the_collators_mask() -> None:
    for mode in ("keep_start", "keep_end"):
        for max_length in (None, 1, 3, 7, 12):
            for prompt in range(0, 6):
                for total in range(prompt, 12):
                    assert completion_tokens(prompt, total, max_length, mode) == \
                        _mask_count(prompt, total, max_length, mode), (mode, max_length, prompt, total)


def test_policy_forwards_carry_both_counts_and_reference_forwards_none() -> None:
    # prompts 10, 20, 5; completions: chosen 90, 280, 45; rejected 120, 70, 20; cut at 256 (keep_start).
    # A shape holds the set of counts its batches met, sorted.
    rows = PairedRows(chosen=(100, 300, 50), rejected=(130, 90, 25), prompt=(10, 20, 5))
    plan = plan_dpo(
        train_rows=rows, layout=DPOLayout(max_length=256, precompute_ref=False),
        loop=TrainLoop(steps_in_epoch=2, gradient_accumulation_steps=1, num_train_epochs=1, max_steps=-1),
        epoch_batches=lambda epoch: [[[0, 2], [1]]], info=RunInfo("dpo", rows=3, pad_to_multiple_of=128))
    by_key = {(s.phase, s.batch, s.seq): s.completion_tokens for s in plan.shapes}
    assert by_key == {
        ("train", 4, 256): (90 + 45, 120 + 20),
        ("train", 2, 256): (70, 236),  # row 1's chosen side is cut at 256: 256 - 20 completion tokens
        ("ref", 4, 256): (),
        ("ref", 2, 256): (),
    }


def test_kto_policy_forwards_carry_desirable_rows_and_both_counts() -> None:
    # prompts 10, 20, 30; completions 90, 180, 20; rows 0 and 2 desirable; cut at 128
    rows = UnpairedRows(lengths=(100, 200, 50), kl_lengths=None, prompt=(10, 20, 30), labels=(True, False, True))
    plan = plan_kto(
        train_rows=rows, layout=KTOLayout(max_length=128, precompute_ref=False),
        loop=TrainLoop(steps_in_epoch=2, gradient_accumulation_steps=1, num_train_epochs=1, max_steps=-1),
        epoch_batches=lambda epoch: [[[0, 1], [2]]], info=RunInfo("kto", rows=3, pad_to_multiple_of=128))
    by_key = {(s.phase, s.batch, s.seq): (s.chosen_rows, s.completion_tokens) for s in plan.shapes}
    assert by_key == {
        # desirable row 0: 90 tokens; undesirable row 1 cut at 128: 128 - 20 (the dropped first position is prompt)
        ("train", 2, 128): ((1,), (90, 108)),
        ("train", 1, 128): ((1,), (0, 20)),  # row 2 alone: desirable, 20 tokens; no undesirable ones
        ("ref", 2, 128): ((), ()),
        ("ref", 1, 128): ((), ()),
    }
