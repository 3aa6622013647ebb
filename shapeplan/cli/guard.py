"""`shapeplan guard`: run a training command in-process with the plan's guard in every Trainer it builds."""

from __future__ import annotations

import click

from ..guard import MODES


@click.command("guard", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None, metavar="PLAN",
              help="The plan the run is checked against (from `shapeplan analyze -o`). Without one the run is only "
                   "recorded.")
@click.option("--on-unplanned", "on_unplanned", type=click.Choice(MODES), default="warn", show_default=True,
              help="A shape the plan lacks: warn (one line and a `shapeplan/unplanned` log entry), error (stop before "
                   "its forward, exit 4) or record (only record it).")
@click.option("--record", "record_path", type=click.Path(dir_okay=False), default=None, metavar="RUN",
              help="Write what the run met to RUN (the plan schema, \"observed\": true), for `shapeplan warm --plan "
                   "RUN` and `shapeplan analyze ... --compare RUN`.")
@click.option("--no-compile", "no_compile", is_flag=True,
              help="Any compile during training is an error (exit 4 at the step boundary that counted it): for the "
                   "run after a bake, where everything should load from the cache.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def guard_command(plan_path: str | None, on_unplanned: str, record_path: str | None, no_compile: bool,
                  command: tuple[str, ...]) -> None:
    """Run a training command with every Trainer it builds checked against PLAN.

    The command runs in this process (its Trainers get a ShapeGuard among their callbacks); every input shape its
    models receive is checked against the plan before the forward, compiles are counted at step boundaries, and
    one line at the end says whether the plan held.

    \b
    Examples:
      shapeplan guard --plan plan.json -- trl sft --config sft.yaml
      shapeplan guard --plan plan.json --on-unplanned error --record run.json -- python train.py
      accelerate launch --num_processes 2 -m shapeplan guard --plan plan.json -- train.py
    """
    from ..guard.wrapper import command_runner, guarding
    from ..plan.io import load_plan
    from ..warm.backends.neuron import enable_metrics

    enable_metrics()  # before the command's first device op: TorchNeuron reads the switch at its first counter use

    if plan_path is not None:
        load_plan(plan_path)  # a missing or malformed plan is refused before the run starts
    if record_path is not None:  # so is a record that could not be written, or would replace an input
        from ..plan.targets import check_output, named_files

        check_output(record_path, "--record", inputs=named_files([plan_path, *command]))
    run = command_runner(list(command))

    def make_guard() -> object:
        from ..guard.callback import ShapeGuard

        return ShapeGuard(plan_path, on_unplanned=on_unplanned, record=record_path, no_compile=no_compile)

    with guarding(make_guard):
        run()
