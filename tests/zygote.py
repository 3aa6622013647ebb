"""The server half of tests/console.py and tests/forked_python.py: a Python that has imported the libraries the
`shapeplan` console script imports (torch, transformers, datasets, accelerate, peft, TRL's trainers), then forks one
child per request, in which `python ARGV` runs as a fresh interpreter would run it (ARGV a script and its arguments,
or `-m MODULE` and its arguments): its own argv, sys.path, environment, working directory and standard streams (the
caller's, passed over the socket), its exit status the child's.

    python -m tests.zygote SOCKET

What a fresh process would do differently, and why it does not matter here: the libraries above are already
imported, so the server forks only for a request whose environment equals the one it started with, apart from
FORK_SAFE_ENV (variables the libraries read when used, never when imported: checked against their sources) and the
ones `accelerate launch` sets for each rank (RANK_ENV); any other request is answered "fresh" and its client starts
the fresh interpreter itself. Importing the libraries printed nothing (checked: a library warning at import would
reach a real run's stderr) and started no thread a fork could leave holding a lock (a fork keeps only the forking
one).

A request may add PYTHONPATH entries (a test's reward module): the child puts them on sys.path where a fresh
process has them, unless one holds a module already imported here or a sitecustomize; then the answer is "fresh".

Protocol, one request per connection, requests served side by side (the ranks of one launch): the client sends a
JSON header {"argv", "cwd", "env"} with its three standard stream fds (SCM_RIGHTS); the server answers the child's
pid as a line (or "fresh"), then its wait status as a line (the returncode subprocess would give: negative for a
signal).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import select
import signal
import socket
import sys
import threading
from pathlib import Path

# The third-party modules the console script's commands import, heaviest first.
PRELOAD = ("torch", "transformers", "datasets", "accelerate", "accelerate.commands.launch", "peft", "trl",
           *(f"trl.scripts.{m}" for m in ("sft", "grpo", "rloo", "dpo", "kto", "reward", "distillation")),
           *(f"trl.trainer.{m}_trainer" for m in ("sft", "grpo", "rloo", "dpo", "kto", "reward", "distillation")))


# Read by shapeplan, torch, transformers, datasets, accelerate or TRL when used, never when they are imported; each
# test sets its own (tests/conftest.py). The server puts PYTHONPATH on sys.path itself (below).
FORK_SAFE_ENV = {"TORCHINDUCTOR_CACHE_DIR", "SHAPEPLAN_CACHE_DIR", "PYTEST_CURRENT_TEST", "PYTHONPATH",
                 "SHAPEPLAN_TESTS_ZYGOTE", "SHAPEPLAN_IMAGE_TIMEOUT", "SHAPEPLAN_IMAGE_MAX_MIB", "_"}
# What `accelerate launch` (torch's elastic agent) adds to each rank's environment, all read when the process group
# and the Accelerator are set up (no module of the libraries above reads one at import).
RANK_ENV = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE",
            "ACCELERATE_DYNAMO_USE_FULLGRAPH", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"}


def signature(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What of `env` a fork of a server started with it cannot change: the variables read at import."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k not in FORK_SAFE_ENV and k not in RANK_ENV and not k.startswith("TORCHELASTIC_")))


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


def _child(argv: list[str], cwd: str, env: dict[str, str], fds: list[int]) -> None:
    """Become `python ARGV` (never returns)."""
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
        module = argv[1] if argv[0] == "-m" else None
        # as the interpreter does: the script's folder (the working directory for -m), then PYTHONPATH, the rest
        first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
        sys.path[: 1 + len(_entries(STARTED_WITH))] = [first, *_entries(env)]
        sys.argv = [argv[0], *argv[2:]] if module else list(argv)
        try:
            if module:
                sys.modules.pop(module, None)  # preloaded here, never imported under its name by `python -m` itself
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(argv[0], run_name="__main__")
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


def _unfit_request(argv: list[str], env: dict[str, str]) -> str:
    if not argv or (argv[0].startswith("-") and argv[0] != "-m") or (argv[:1] == ["-m"] and len(argv) < 2):
        return "only `python SCRIPT ARGS` and `python -m MODULE ARGS` are forked"
    if signature(env) != signature(STARTED_WITH):
        return "its environment differs in a variable read at import"
    return _shadowing(env)


def _serve(connection: socket.socket) -> None:
    """Answer one request, in a process of its own (forked from the server, so the server takes the next request at
    once): fork the child, send its pid, wait for it, send its status."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    request = json.loads(message)
    if _unfit_request(request["argv"], request["env"]):
        for fd in fds:
            os.close(fd)
        connection.sendall(b"fresh\n")  # the client starts it as a fresh process
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        connection.close()
        _child(request["argv"], request["cwd"], request["env"], fds)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):  # a client past its timeout has killed the child and gone
        connection.sendall(f"{pid}\n".encode())
    # A client that goes before its child ends (killed, as a launcher kills the ranks of a failed run) takes the
    # child along: run fresh, the two would be one process.
    child = os.pidfd_open(pid)
    while child not in select.select([child, connection], [], [])[0]:
        if not connection.recv(1):
            os.kill(pid, signal.SIGKILL)
            break
    os.close(child)
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
    server.listen(16)
    print(json.dumps({"unfit": unfit}), flush=True)  # ready
    if unfit:
        return
    while True:
        connection, _ = server.accept()
        with contextlib.suppress(ChildProcessError):  # the requests answered since the last one
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        if os.fork() == 0:
            server.close()
            code = 1
            try:
                with connection:
                    _serve(connection)
                code = 0
            finally:
                os._exit(code)
        connection.close()


if __name__ == "__main__":
    main()
