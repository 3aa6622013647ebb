"""`schedule.micro_batches` and `evaluation_steps` against the real `transformers.Trainer` loop.

The oracle is a real Trainer (sequential order, a one-parameter model) recording which batch each forward
receives and at which global step: cheap enough to check many edge cases of epochs, gradient accumulation,
max_steps, drop_last and the eval rules.
"""

from __future__ import annotations

import math

import pytest

from shapeplan.plan.schedule import TrainLoop, evaluation_steps, micro_batches

# (rows, batch, GA, epochs, max_steps, drop_last, eval_strategy, eval_steps, eval_delay, eval_on_start)
CASES = {
    "ga-divides": (10, 3, 2, 2, -1, False, "steps", 3, 0, False),
    "fractional-epochs-short-last-update": (10, 3, 3, 1.5, -1, False, "steps", 2, 0, False),
    "ga-equals-epoch": (10, 3, 4, 1, -1, False, "no", None, 0, False),
    "ga-longer-than-epoch": (10, 3, 5, 2, -1, False, "epoch", None, 0, False),
    "max-steps-mid-epoch": (10, 4, 2, 3, 7, False, "steps", 3, 0, False),
    "fractional-eval-steps-and-delay": (10, 4, 2, 3, 7, False, "steps", 0.3, 4, False),
    "drop-last": (10, 4, 1, 2, -1, True, "steps", 5, 0, True),
    "epoch-eval-cut-by-max-steps": (12, 2, 2, 3, 8, False, "epoch", None, 1.5, False),
    "epoch-eval-delay-past-the-cut-epoch": (12, 2, 2, 3, 8, False, "epoch", None, 2.8, False),
    "half-epoch": (12, 2, 1, 0.5, -1, False, "steps", 2, 0, True),
    "eval-every-step": (6, 4, 1, 2, -1, False, "steps", 1, 0, False),
    "epoch-eval-delay": (9, 2, 2, 3, -1, False, "epoch", None, 2, True),
}
EVAL_ROWS, EVAL_BATCH = 5, 2  # 3 eval forwards per evaluation


def _real_trainer(rows: int, batch: int, ga: int, epochs: float, max_steps: int, drop_last: bool, strategy: str,
                  eval_steps: float | None, eval_delay: float, eval_on_start: bool,
                  tmp_path) -> tuple[list[tuple[int, int, int]], list[int]]:  # type: ignore[no-untyped-def]
    """(epoch, batch index, step) of every train forward, and the global step of every eval forward."""
    import torch
    from transformers import Trainer, TrainingArguments

    class Recorder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, idx):  # type: ignore[no-untyped-def]
            calls.append((self.training, idx.tolist()))
            return {"loss": (self.weight * idx.float()).sum()}

    calls: list[tuple[bool, list[int]]] = []
    steps: list[int] = []
    model = Recorder()
    model.register_forward_pre_hook(lambda module, args: steps.append(trainer.state.global_step))
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=batch, per_device_eval_batch_size=EVAL_BATCH,
        gradient_accumulation_steps=ga, num_train_epochs=epochs, max_steps=max_steps, dataloader_drop_last=drop_last,
        eval_strategy=strategy, eval_steps=eval_steps, eval_delay=eval_delay, eval_on_start=eval_on_start,
        train_sampling_strategy="sequential", use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1000, disable_tqdm=True,
    )
    data = [{"idx": torch.tensor(i)} for i in range(rows)]
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      eval_dataset=[{"idx": torch.tensor(i)} for i in range(EVAL_ROWS)] if strategy != "no" else None)
    trainer.train()
    per_epoch = rows // batch if drop_last else math.ceil(rows / batch)
    train, evals, seen = [], [], 0
    for (training, idx), step in zip(calls, steps, strict=True):
        if training:
            train.append((seen // per_epoch, (idx[0] // batch), step + 1))
            seen += 1
        else:
            evals.append(step)
    return train, evals


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_equals_real_trainer_loop(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rows, batch, ga, epochs, max_steps, drop_last, strategy, eval_steps, eval_delay, eval_on_start = CASES[name]
    real_train, real_evals = _real_trainer(rows, batch, ga, epochs, max_steps, drop_last, strategy, eval_steps,
                                           eval_delay, eval_on_start, tmp_path)
    loop = TrainLoop(steps_in_epoch=rows // batch if drop_last else math.ceil(rows / batch),
                     gradient_accumulation_steps=ga, num_train_epochs=epochs, max_steps=max_steps)
    assert [(mb.epoch, mb.index, mb.step) for mb in micro_batches(loop)] == real_train
    planned = evaluation_steps(loop, eval_strategy=strategy, eval_steps=eval_steps if eval_steps is not None else 500,
                               eval_delay=eval_delay, eval_on_start=eval_on_start)
    forwards_per_eval = EVAL_ROWS // EVAL_BATCH if drop_last else math.ceil(EVAL_ROWS / EVAL_BATCH)
    assert [step for step in planned for _ in range(forwards_per_eval)] == real_evals


def test_no_batches_means_no_micro_batches() -> None:
    loop = TrainLoop(steps_in_epoch=0, gradient_accumulation_steps=2, num_train_epochs=3, max_steps=-1)
    assert list(micro_batches(loop)) == []
    assert evaluation_steps(loop, eval_strategy="steps", eval_steps=1, eval_delay=0, eval_on_start=True) == [0]


def test_stream_passes_of_different_lengths_step_within_each_pass() -> None:
    """A stream read again pass after pass: each pass steps after every GA of its own micro-batches; a pass's
    leftover micro-batches run no step and join the next pass's first; the last pass length repeats."""
    loop = TrainLoop(steps_in_epoch=10, gradient_accumulation_steps=2, num_train_epochs=1, max_steps=5,
                     batches_per_pass=(5, 3))
    run = [(mb.epoch, mb.index, mb.step, mb.steps) for mb in micro_batches(loop)]
    assert run == [(0, 0, 1, False), (0, 1, 1, True), (0, 2, 2, False), (0, 3, 2, True), (0, 4, 3, False),
                   (1, 0, 3, False), (1, 1, 3, True), (1, 2, 4, False),
                   (2, 0, 4, False), (2, 1, 4, True), (2, 2, 5, False), (3, 0, 5, False), (3, 1, 5, True)]
