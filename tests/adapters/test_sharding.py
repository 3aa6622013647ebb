"""The per-rank batches the planner replays equal what accelerate's own `prepare_data_loader` hands each rank, for
every `--accelerator_config` dataloader option (`split_batches`, `even_batches`), map-style and streamed; and the
combinations accelerate or the Trainer fail on are one-line usage errors."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from shapeplan.adapters.sampling import Sharding, eval_batches
from shapeplan.adapters.stream import rank_batches
from shapeplan.errors import UsageError
from shapeplan.services.analyze import analyze
from tests.conftest import ROOT, TINY_MODEL, TLDR


def _prepared(dataset, *, batch_size: int, ranks: int, split: bool, even: bool = True,  # type: ignore[no-untyped-def]
              drop_last: bool = False) -> list[list[list[int]]]:
    """Each rank's batches of row numbers from accelerate's own prepared DataLoader."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    out = []
    for rank in range(ranks):
        loader = prepare_data_loader(DataLoader(dataset, batch_size=batch_size, drop_last=drop_last),
                                     num_processes=ranks, process_index=rank, split_batches=split,
                                     even_batches=even, dispatch_batches=False, put_on_device=False)
        out.append([batch.tolist() for batch in loader])
    return out


@pytest.mark.parametrize(("rows", "batch_size", "ranks"), [(7, 2, 2), (8, 4, 2), (13, 4, 2), (3, 4, 2), (11, 3, 3),
                                                           (20, 6, 3)])
@pytest.mark.parametrize(("split", "even", "drop_last"), [(False, True, False), (True, True, False),
                                                          (False, False, False), (True, False, False),
                                                          (True, True, True)])
def test_map_style_batches_are_the_prepared_dataloaders(rows: int, batch_size: int, ranks: int, split: bool,
                                                        even: bool, drop_last: bool) -> None:
    sharding = Sharding(num_processes=ranks, split_batches=split, even_batches=even)
    real = _prepared(range(rows), batch_size=batch_size, ranks=ranks, split=split, even=even, drop_last=drop_last)
    if split and batch_size % ranks:
        with pytest.raises(ValueError, match="round multiple"):  # accelerate refuses it
            _prepared(range(rows), batch_size=batch_size, ranks=ranks, split=True)
        with pytest.raises(UsageError, match="set per_device_eval_batch_size to a multiple of --num_processes"):
            sharding.rank_batch_size(batch_size, "per_device_eval_batch_size")
        return
    if len({len(rank) for rank in real}) > 1:  # even_batches=False left the ranks unequal
        with pytest.raises(UsageError, match="the Trainer's ranks fall out of step"):
            eval_batches(rows, batch_size=batch_size, sharding=sharding, drop_last=drop_last)
        return
    assert eval_batches(rows, batch_size=batch_size, sharding=sharding, drop_last=drop_last) == real
    if split:
        assert {len(b) for rank in real for b in rank} <= set(range(batch_size // ranks + 1))


def test_even_batches_false_leaves_the_last_batch_short() -> None:
    """7 rows in batches of 2 on 2 ranks: 4 batches, 2 per rank; rank 1's last holds 1 row, not 2 wrapped around."""
    even = eval_batches(7, batch_size=2, sharding=Sharding(2), drop_last=False)
    uneven = eval_batches(7, batch_size=2, sharding=Sharding(2, even_batches=False), drop_last=False)
    assert even == [[[0, 1], [4, 5]], [[2, 3], [6, 0]]]
    assert uneven == [[[0, 1], [4, 5]], [[2, 3], [6]]]


class _Rows:
    """A stream of row numbers (torch's IterableDataset, as accelerate shards a stream of one file)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.rows))


@pytest.mark.parametrize(("rows", "batch_size", "ranks"), [(10, 4, 2), (13, 4, 2), (3, 4, 2), (20, 6, 3)])
@pytest.mark.parametrize("split", [False, True])
def test_stream_batches_are_the_prepared_dataloaders(rows: int, batch_size: int, ranks: int, split: bool) -> None:
    from torch.utils.data import IterableDataset

    stream = type("Stream", (_Rows, IterableDataset), {})(rows)
    real = _prepared(stream, batch_size=batch_size, ranks=ranks, split=split)
    planned = rank_batches([rows], batch_size=batch_size, option="per_device_train_batch_size",
                           sharding=Sharding(ranks, split_batches=split))
    assert planned == real


def test_split_batches_refusals_name_the_option() -> None:
    with pytest.raises(UsageError, match=r"^split_batches cuts each batch of per_device_train_batch_size=1 into 2 "):
        Sharding(2, split_batches=True).rank_batch_size(1, "per_device_train_batch_size")
    assert Sharding(2, split_batches=True).rank_batch_size(6, "x") == 3
    assert Sharding(1, split_batches=True).rank_batch_size(5, "x") == 5
    assert list(itertools.chain.from_iterable(
        eval_batches(4, batch_size=4, sharding=Sharding(2, split_batches=True), drop_last=False))) == [[0, 1], [2, 3]]


TEXT = ROOT / "tests" / "fixtures" / "text.jsonl"  # 30 rows
EXPLICIT = ROOT / "tests" / "fixtures" / "preference-explicit.jsonl"


@pytest.mark.parametrize(("method", "data", "argv", "message"), [
    ("sft", TEXT, ["--per_device_train_batch_size", "3", "--accelerator_config", '{"split_batches": true}'],
     "split_batches cuts each batch of per_device_train_batch_size=3 into 2 equal slices"),
    ("sft", TEXT, ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "5", "--eval_strategy",
                   "epoch", "--dataset_test_split", "train", "--accelerator_config", '{"split_batches": true}'],
     "split_batches cuts each batch of per_device_eval_batch_size=5 into 2 equal slices"),
    # 30 rows in batches of 7: 5 batches, 3 on rank 0 and 2 on rank 1
    ("sft", TEXT, ["--per_device_train_batch_size", "7", "--accelerator_config", '{"even_batches": false}'],
     "with even_batches=false the ranks get 2 and 3 batches of 30 rows"),
    ("sft", TEXT, ["--train_sampling_strategy", "batch_rebalance", "--accelerator_config", '{"split_batches": true}'],
     "accelerate refuses split_batches with train_sampling_strategy='batch_rebalance'"),
    ("sft", TEXT, ["--padding_free", "--max_length", "none", "--accelerator_config", '{"dispatch_batches": true}'],
     "dispatch_batches=true slices each collated batch by rows across the ranks, and a padding-free batch"),
    # DPO's and Reward's collator stacks every chosen sequence, then every rejected one: a row slice of a whole
    # batch hands one rank chosen sequences only
    ("dpo", EXPLICIT, ["--per_device_train_batch_size", "4", "--accelerator_config",
                       '{"dispatch_batches": true, "split_batches": true}'],
     "dispatch_batches=true with split_batches: rank 0 collates each batch as every chosen sequence then every "
     "rejected one"),
    # 40 pairs in batches of 3: the last group is a batch of 3 pairs and one of 1, cut into two slices of 4 rows
    ("reward", EXPLICIT, ["--per_device_train_batch_size", "3", "--accelerator_config", '{"dispatch_batches": true}'],
     "dispatch_batches=true: rank 0 concatenates the last 2 batch(es) of 3 and 1 pairs"),
    ("dpo", EXPLICIT, ["--per_device_train_batch_size", "4", "--precompute_ref_log_probs", "--accelerator_config",
                       '{"dispatch_batches": true}'],
     "dispatch_batches=true with precompute_ref_log_probs: rank 0 slices each batch's reference log-probs"),
    ("grpo", TLDR, ["--per_device_train_batch_size", "4", "--num_generations", "2", "--accelerator_config",
                    '{"dispatch_batches": true}'],
     "dispatch_batches=true on several ranks: rank 0 would concatenate or broadcast grpo's batches"),
])
def test_what_two_ranks_refuse_is_one_usage_line(method: str, data: Path, argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as info:
        analyze(method, ["--dataset_name", str(data), "--model_name_or_path", str(TINY_MODEL), "--num_processes",
                         "2", "--max_steps", "2", *argv], use_cache=False)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_dispatched_pairs_are_whole_collated_batches() -> None:
    """Without split_batches rank 0 concatenates one batch per rank; when the batches are alike each rank's row slice
    is one whole collated batch (its pairs' chosen and rejected sequences), as without dispatch."""
    from shapeplan.adapters.sampling import ordered_batches

    shards = Sharding(num_processes=2, dispatch_batches=True, halves=True)
    ranks = ordered_batches(list(range(16)), batch_size=4, sharding=shards, drop_last=False)
    assert [[list(b) for b in rank] for rank in ranks] == [[[0, 1, 2, 3], [8, 9, 10, 11]],
                                                           [[4, 5, 6, 7], [12, 13, 14, 15]]]
    assert ranks[1][0].parts == ((0, 1, 2, 3), (4, 5, 6, 7))
    # 18 pairs: drop_last keeps whole groups only, so the slices stay whole batches
    dropped = ordered_batches(list(range(18)), batch_size=4, sharding=shards, drop_last=True)
    assert [len(rank) for rank in dropped] == [2, 2]
    with pytest.raises(UsageError, match=r"^dispatch_batches=true: rank 0 concatenates the last 1 batch\(es\) of 2 "):
        ordered_batches(list(range(18)), batch_size=4, sharding=shards, drop_last=False)
