"""The `shapeplan` command line. Heavy imports live inside command bodies so `--help` stays fast."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback

import click

from .. import __version__
from ..errors import ShapeplanError
from .advise import advise_command
from .analyze import analyze_command
from .cache import cache_group
from .doctor import doctor_command
from .guard import guard_command
from .verify import verify_command
from .warm import warm_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="shapeplan")
def cli() -> None:
    """Plan and pre-compile every input shape a TRL run feeds the model on AWS Trainium.

    Take the arguments you give `trl sft` (or grpo, rloo, dpo, kto, reward, distillation), plan the run's
    shapes, compile them before training, and check that training will compile nothing:

    \b
      shapeplan analyze trl-lib/Capybara --model Qwen/Qwen3-0.6B -o plan.json
      shapeplan warm --plan plan.json
      shapeplan verify --plan plan.json

    On a new host, run `shapeplan doctor` first.

    Run `shapeplan COMMAND --help` for each command's options.
    """


cli.add_command(analyze_command)
cli.add_command(advise_command)
cli.add_command(warm_command)
cli.add_command(verify_command)
cli.add_command(cache_group)
cli.add_command(doctor_command)
cli.add_command(guard_command)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every `ShapeplanError` becomes one line on stderr and its exit code (with `SHAPEPLAN_DEBUG=1`,
    the traceback behind it first, for a bug report). Without `argv` (the process's own command line: the
    `shapeplan` command, `python -m shapeplan`) the process ends with the command."""
    try:
        code = _run(argv)
    finally:
        _leave_process_group()
    if argv is None and sys.argv[1:2] != ["guard"]:  # guard runs the user's training here: its objects end as usual
        _end_process(code)
    return code


def _end_process(code: int) -> None:
    """End the process as the interpreter ends it (threads joined, exit handlers run, stdout and stderr flushed) but
    without the teardown of every module and object that follows, which the user waits through after a command that
    loaded torch (measured on 2 cores: 0.9 s of a 200-row analyze's 4.4 s, 1.9 s of a warm-up's 36 s). Not under a
    profiler or tracer, which report at that teardown."""
    shutdown, exit_handlers = getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or exit_handlers is None or sys.getprofile() is not None or sys.gettrace() is not None:
        return
    shutdown()  # what the interpreter does first: threading's exit hooks (executors), then non-daemon threads joined
    exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _leave_process_group() -> None:
    """Under `accelerate launch` (warm, guard) tear the ranks' process group down before exit: left to the
    interpreter's teardown, gloo's threads now and then abort a rank that has finished ("terminate called without
    an active exception", exit -6; a 2-rank gloo script aborted in 4 of 15 runs without the teardown, in none of 15
    with it), failing a run that succeeded."""
    torch = sys.modules.get("torch")  # never imported by a command that cannot have started one
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _writing_stdout(exc: OSError) -> bool:
    """Whether `exc` was raised writing stdout (a full device, a closed pipe): by click.echo to file descriptor 1,
    or by the final flush."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "echo" and frame.f_globals.get("__name__") == "click.utils":
            try:
                return bool(frame.f_locals["file"].fileno() == 1)
            except (KeyError, AttributeError, OSError, ValueError):
                return False
        if frame.f_code.co_name == "_run" and frame.f_globals.get("__name__") == __name__ and tb.tb_next is None:
            return True  # the flush below
        tb = tb.tb_next
    return False


def _drop_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail (and print) again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _run(argv: list[str] | None) -> int:
    try:
        # without standalone mode click *returns* the code of a `ctx.exit(n)` / `Exit(n)` instead of raising it
        code = cli.main(args=argv, prog_name="shapeplan", standalone_mode=False)
        sys.stdout.flush()  # a full or closed stdout fails here, not at exit
    except OSError as exc:
        if not _writing_stdout(exc):
            raise
        _drop_stdout()
        click.echo(f"Error: cannot write to stdout: {exc.strerror or exc}; redirect it to a file or device with "
                   "room (or write a plan with -o PLAN)", err=True)
        return 1
    except ShapeplanError as exc:
        if os.environ.get("SHAPEPLAN_DEBUG") == "1":
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        click.echo(f"Error: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:  # Ctrl-C at a prompt or in a command (a RuntimeError: before the handler below)
        click.echo("Interrupted.", err=True)
        return 130
    except click.exceptions.NoArgsIsHelpError as exc:  # `shapeplan` alone: its help, as `shapeplan --help` shows it
        if exc.ctx is not None:
            click.echo(exc.ctx.get_help())
        return 0
    except RuntimeError as exc:
        from ..warm.backends.neuron import autoload_failed, unimportable

        if not autoload_failed(exc):
            raise
        click.echo(f"Error: {unimportable(exc)}", err=True)  # `import torch` itself failed: one line, no traceback
        return 2
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:  # click's usage errors, as one line like every other error
        hint = f"; see `{exc.ctx.command_path} --help`" if isinstance(exc, click.UsageError) and exc.ctx else ""
        click.echo(f"Error: {exc.format_message().splitlines()[0].rstrip('.')}{hint}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
