"""The server half of tests/console.py: a Python that has imported the libraries the `shapeplan` console script
imports (torch, transformers, datasets, accelerate, peft, TRL's trainers), then forks one child per request, in
which the installed console script runs as `python SCRIPT ARGS` would run it: its own argv, environment, working
directory and standard streams (the caller's pipes, passed over the socket), its exit status the child's.

    python -m tests.zygote SOCKET

What a fresh process would do differently, and why it does not matter here: the libraries above are already
imported (tests/console.py only sends a request whose environment equals the one this process started with, apart
from the variables the libraries read when used rather than when imported, and never `guard`, which hooks the
imports of the command it runs). Importing them printed nothing (checked: a library warning at import would reach a
real run's stderr) and started no thread a fork could leave holding a lock (a fork keeps only the forking one).

A request may add PYTHONPATH entries (a test's reward module): the child puts them on sys.path where a fresh
process has them, unless one holds a module already imported here or a sitecustomize; then the server answers
"fresh" and the client starts the script as a fresh process.

Protocol, one request per connection: the client sends a JSON header {"script", "argv", "cwd", "env"} with the
three stream fds (SCM_RIGHTS); the server answers the child's pid as a line (or "fresh"), then its wait status as a
line (the returncode subprocess would give: negative for a signal).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import socket
import sys
import threading
from pathlib import Path

# The third-party modules the console script's commands import, heaviest first.
PRELOAD = ("torch", "transformers", "datasets", "accelerate", "accelerate.commands.launch", "peft", "trl",
           *(f"trl.scripts.{m}" for m in ("sft", "grpo", "rloo", "dpo", "kto", "reward", "distillation")),
           *(f"trl.trainer.{m}_trainer" for m in ("sft", "grpo", "rloo", "dpo", "kto", "reward", "distillation")))


# Native threads a fork may leave behind: jemalloc's (pyarrow's allocator) locks its arenas around fork() and
# starts again in the child.
FORK_SAFE_THREADS = {"jemalloc_bg_thd"}


def _preload() -> str:
    """Import PRELOAD; what it printed, or why a fork would not be a fresh process (empty: fit to serve)."""
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
        for name in PRELOAD:
            importlib.import_module(name)
    if captured.getvalue():
        return f"importing the libraries printed: {captured.getvalue()[:500]!r}"
    native = sorted(Path(f"/proc/self/task/{task}/comm").read_text().strip()
                    for task in os.listdir("/proc/self/task"))
    native.remove(Path("/proc/self/comm").read_text().strip())  # this thread
    if threading.active_count() != 1 or set(native) - FORK_SAFE_THREADS:
        return f"importing the libraries started a thread: {native}"
    return ""


def _exit_code(error: SystemExit) -> int:
    """The status the interpreter gives `raise SystemExit(code)` (printing a non-int code, as it does)."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _child(script: str, argv: list[str], cwd: str, env: dict[str, str], fds: list[int]) -> None:
    """Become `python SCRIPT ARGV` (never returns)."""
    import atexit
    import runpy
    import traceback

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [script, *argv]
        # as for a script run by path: its folder, then PYTHONPATH, then the rest
        sys.path[: 1 + len(_entries(STARTED_WITH))] = [os.path.dirname(script), *_entries(env)]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as error:
            code = _exit_code(error)
        except BaseException:  # what the interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    finally:
        os._exit(code)


def _entries(env: dict[str, str]) -> list[str]:
    return [os.path.abspath(e) for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]


def _shadowing(env: dict[str, str]) -> str:
    """What a PYTHONPATH entry this process did not start with holds that a fresh process would import instead of
    what is imported here (a module of that name, or a sitecustomize the interpreter imports at start)."""
    for entry in set(_entries(env)) - set(_entries(STARTED_WITH)):
        names = {Path(n).stem for n in os.listdir(entry)} if os.path.isdir(entry) else set()
        clash = names & ({"sitecustomize", "usercustomize"} | {m.partition(".")[0] for m in sys.modules})
        if clash:
            return f"{entry} holds {sorted(clash)}"
    return ""


def _serve(connection: socket.socket) -> None:
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    request = json.loads(message)
    if _shadowing(request["env"]):
        for fd in fds:
            os.close(fd)
        connection.sendall(b"fresh\n")  # the client runs it as a fresh process
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        connection.close()
        _child(request["script"], request["argv"], request["cwd"], request["env"], fds)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):  # a client past its timeout has killed the child and gone
        connection.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    with contextlib.suppress(OSError):
        connection.sendall(f"{code}\n".encode())


STARTED_WITH = dict(os.environ)


def main() -> None:
    path = sys.argv[1]
    unfit = _preload()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    print(json.dumps({"unfit": unfit}), flush=True)  # ready
    if unfit:
        return
    while True:
        connection, _ = server.accept()
        with connection:
            _serve(connection)


if __name__ == "__main__":
    main()
