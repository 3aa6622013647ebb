"""The installed `shapeplan` console script in a subprocess, as a shell runs it, without paying its imports again.

`run(args, ...)` returns what `subprocess.run([SHAPEPLAN, *args], capture_output=True, text=True)` returns: the
process's exit code, stdout and stderr. Most of a console call that reaches TRL is importing torch, transformers,
datasets, accelerate, peft and TRL (about 14 s of CPU on the 2-core CI machine), so each xdist worker keeps one
server (tests/zygote.py) that imported them once and forks a child per call; the child runs the installed script
file itself (`.venv/bin/shapeplan`), with the call's argv, environment and working directory, writing to this
call's own pipes, and its exit status is the returncode.

A call runs as a fresh `subprocess.run` instead where a fork could differ from a fresh process: an environment
that differs from the server's in a variable a library may read at import, `guard` of a
command other than `trl <method>` (it runs the command's first lines before torch loads, and a fork has loaded it;
`trl` loads torch to parse its options before the guard runs anything, so there the two are the same), standard
input, or SHAPEPLAN_TESTS_FRESH=1 (every call fresh:
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
from tests.zygote import signature

SHAPEPLAN = str(Path(sys.executable).parent / "shapeplan")


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
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
            header = json.dumps({"argv": [SHAPEPLAN, *args], "cwd": cwd, "env": env}).encode()
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
    forkable = os.environ.get("SHAPEPLAN_TESTS_FRESH") != "1" and (argv[:1] != ["guard"] or _guards_trl(argv))
    server = _server_for(env) if forkable else None
    if server is None:
        return fresh(argv, cwd, env, timeout)
    return server.run(argv, str(cwd), env, timeout)


def _guards_trl(argv: list[str]) -> bool:
    """`guard ... -- trl <method> ...`: the command parses its options with TRL, so torch is loaded before the
    guard hooks anything whether the process is forked or fresh (shapeplan/guard/wrapper.py)."""
    return "--" in argv and argv[argv.index("--") + 1:][:1] == ["trl"]


def fresh(argv: list[str], cwd: Path | str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """The console script started as a new process."""
    return subprocess.run([SHAPEPLAN, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _server_for(env: dict[str, str]) -> _Server | None:
    """The worker's server for `env`, if it has one, or `env` is the suite's usual environment (a one-off environment
    gains nothing from a server, which costs what one call does)."""
    if signature(env) in _servers or signature(env) == signature({**os.environ, "PYTHONPATH": str(ROOT)}):
        return server(env)
    return None


def server(env: dict[str, str]) -> _Server | None:
    """The worker's server for `env` (started now if it has none): for a test module whose many processes share an
    environment other than the usual one. Its socket, as SHAPEPLAN_TESTS_ZYGOTE, lets tests/forked_python.py stand
    for `python` in processes the test does not start itself (the ranks of an `accelerate launch`)."""
    key = signature(env)
    if key not in _servers:
        _servers[key] = _Server(env)
    found = _servers[key]
    return None if found.unfit else found


def forked_python(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(the command prefix that stands for `python`, the environment to run it in): tests/forked_python.py and
    `env` naming the worker's server for it; `python` itself where the server is unfit or SHAPEPLAN_TESTS_FRESH=1."""
    found = None if os.environ.get("SHAPEPLAN_TESTS_FRESH") == "1" else server(env)
    if found is None:
        return [sys.executable], env
    return [sys.executable, str(ROOT / "tests" / "forked_python.py")], {**env, "SHAPEPLAN_TESTS_ZYGOTE": found.path}
