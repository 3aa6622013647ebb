"""Script mode: a user's training script run in this process up to the trainer it trains (`command.py`: the
command as Python runs it; `capture.py`: the trainer's arguments taken at its construction; `run.py`: those
arguments as the `TrainingArgs` the planners and warmers read)."""
