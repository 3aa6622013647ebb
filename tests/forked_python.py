"""`python ARGS`, run as a fork of the test worker's server (tests/zygote.py) instead of a new interpreter that
imports torch, transformers and TRL again: for the processes a test cannot start through tests/console.py itself,
the ranks of an `accelerate launch` above all (`accelerate launch ... tests/forked_python.py -m MODULE ARGS`).

    SHAPEPLAN_TESTS_ZYGOTE=SOCKET python tests/forked_python.py ARGS

It imports only the standard library, hands the server its argv, environment, working directory and standard
streams, forwards the signals a launcher stops its workers with, and exits as the child did. Without
SHAPEPLAN_TESTS_ZYGOTE, or where the server answers "fresh" (an environment it was not started with), it becomes
`python ARGS` itself.
"""

import json
import os
import signal
import socket
import sys


def _fresh() -> None:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


def main() -> None:
    path = os.environ.get("SHAPEPLAN_TESTS_ZYGOTE")
    if not path:
        _fresh()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    header = json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(client, [header], [0, 1, 2])
    replies = client.makefile("rb")
    first = replies.readline().strip()
    if first in (b"fresh", b""):
        client.close()
        _fresh()
    pid = int(first)

    def forward(signum: int, _frame: object) -> None:
        os.kill(pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, forward)
    code = int(replies.readline() or b"1")
    if code < 0:  # ended by a signal: end by it too, as the parent of `python ARGS` would see
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
