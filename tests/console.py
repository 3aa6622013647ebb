"""The installed `shapeplan` console script in a subprocess, as a shell runs it, without paying its imports again.

`run(args, ...)` returns what `subprocess.run([SHAPEPLAN, *args], capture_output=True, text=True)` returns: the
process's exit code, stdout and stderr. Most of a console call that reaches TRL is importing torch, transformers,
datasets, accelerate, peft and TRL (about 14 s of CPU on the 2-core CI machine), so each xdist worker keeps one
server (tests/zygote.py) that imported them once and forks a child per call; the child runs the installed script
file itself (`.venv/bin/shapeplan`), with the call's argv, environment and working directory, writing to this
call's own pipes, and its exit status is the returncode.

A call runs as a fresh `subprocess.run` instead where a fork could differ from a fresh process: an environment
that differs from the server's in a variable a library may read at import (any but FORK_SAFE_ENV), `guard` (it hooks
the imports of the command it runs), standard input, or SHAPEPLAN_TESTS_FRESH=1 (every call fresh:
`SHAPEPLAN_TESTS_FRESH=1 make test` checks that nothing depends on the server). tests/test_console.py holds the two
ways equal.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import ROOT

SHAPEPLAN = str(Path(sys.executable).parent / "shapeplan")
# Read by shapeplan or torch when used, never when a library is imported; each test sets its own (conftest.py).
FORK_SAFE_ENV = {"TORCHINDUCTOR_CACHE_DIR", "SHAPEPLAN_CACHE_DIR", "PYTEST_CURRENT_TEST",
                 "PYTHONPATH"}  # the server puts PYTHONPATH on sys.path itself (tests/zygote.py)


def _signature(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k not in FORK_SAFE_ENV))


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.signature = _signature(env)
        self.folder = tempfile.mkdtemp(prefix="shapeplan-zygote-")
        self.path = os.path.join(self.folder, "socket")
        self.process = subprocess.Popen([sys.executable, "-m", "tests.zygote", self.path], cwd=ROOT, env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        ready = self.process.stdout.readline()
        self.unfit = json.loads(ready)["unfit"] if ready else "the server exited while importing"
        atexit.register(self.close)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if os.path.exists(self.path):
            os.unlink(self.path)
        if os.path.isdir(self.folder):
            os.rmdir(self.folder)

    def run(self, args: list[str], cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client.connect(self.path)
            header = json.dumps({"script": SHAPEPLAN, "argv": args, "cwd": cwd, "env": env}).encode()
            socket.send_fds(client, [header], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        return _collect(client, out_r, err_r, [SHAPEPLAN, *args], cwd, env, timeout)


def _collect(client: socket.socket, out_r: int, err_r: int, command: list[str], cwd: str, env: dict[str, str],
             timeout: float) -> subprocess.CompletedProcess[str]:
    """Read the child's two pipes to their end and its pid and status from the server, as `communicate` would."""
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    replies = b""
    deadline = time.monotonic() + timeout
    selector = selectors.DefaultSelector()
    for fd in (out_r, err_r):
        selector.register(fd, selectors.EVENT_READ)
    selector.register(client, selectors.EVENT_READ)
    open_ends = 3
    try:
        while open_ends:
            left = deadline - time.monotonic()
            if left <= 0:
                if b"\n" in replies:  # the child's pid came: kill it, as subprocess.run does on a timeout
                    os.kill(int(replies.split(b"\n")[0]), signal.SIGKILL)
                raise subprocess.TimeoutExpired(command, timeout)
            for key, _ in selector.select(left):
                if key.fileobj is client:
                    data = client.recv(4096)
                    replies += data
                    if replies.startswith(b"fresh\n"):  # the server will not fork this one (tests/zygote.py)
                        open_ends = 0
                        break
                else:
                    data = os.read(key.fd, 1 << 16)
                    chunks[key.fd].append(data)
                if not data:
                    selector.unregister(key.fileobj)
                    open_ends -= 1
    finally:
        selector.close()
        client.close()
        os.close(out_r)
        os.close(err_r)
    lines = replies.split(b"\n")
    if lines[0] == b"fresh":
        return fresh(command[1:], cwd, env, timeout)
    code = int(lines[1])

    def text(fd: int) -> str:  # as text=True decodes: the locale's encoding, universal newlines
        return b"".join(chunks[fd]).decode().replace("\r\n", "\n").replace("\r", "\n")

    return subprocess.CompletedProcess(command, code, text(out_r), text(err_r))


_servers: dict[tuple[tuple[str, str], ...], _Server] = {}


def run(args: list[str | Path] | tuple[str | Path, ...], *, cwd: Path | str = ROOT, env: dict[str, str] | None = None,
        timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([SHAPEPLAN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`;
    `env` defaults to this process's environment with PYTHONPATH the checkout."""
    argv = [str(a) for a in args]
    env = dict(env) if env is not None else {**os.environ, "PYTHONPATH": str(ROOT)}
    forkable = os.environ.get("SHAPEPLAN_TESTS_FRESH") != "1" and argv[:1] != ["guard"]
    server = _server_for(env) if forkable else None
    if server is None:
        return fresh(argv, cwd, env, timeout)
    return server.run(argv, str(cwd), env, timeout)


def fresh(argv: list[str], cwd: Path | str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """The console script started as a new process."""
    return subprocess.run([SHAPEPLAN, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _server_for(env: dict[str, str]) -> _Server | None:
    """The worker's server for `env`: started by the first call with the suite's usual environment (a one-off
    environment gains nothing from a server, which costs what one call does)."""
    signature = _signature(env)
    if signature in _servers:
        server = _servers[signature]
        return None if server.unfit else server
    usual = _signature({**os.environ, "PYTHONPATH": str(ROOT)})
    if signature != usual:
        return None
    _servers[signature] = server = _Server(env)
    return None if server.unfit else server
