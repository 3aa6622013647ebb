"""A real S3 server on loopback for the store's tests: moto's standalone server (`moto[server]`), started by the
tests on 127.0.0.1 with a port of its choosing, stopped when they end (and by `timeout` if they die first). Its
request log lets a test count the objects a push or pull transferred (a ranged GET, 206, is logged in two colours)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_RUNNING = re.compile(r"Running on (http://127\.0\.0\.1:\d+)")
_REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*(GET|PUT|HEAD|POST|DELETE) (\S+) HTTP/1\.1(?:\x1b\[0m)?" (\d+)')
LIFETIME_S = 1800  # the server stops itself after this, whatever happens to the tests


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    log: Path

    def env(self) -> dict[str, str]:
        """The variables a user sets for an S3-compatible endpoint: the client's own, nothing of shapeplan's."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}

    def requests(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request so far."""
        return [(m[1], m[2], int(m[3])) for m in _REQUEST.finditer(self.log.read_text(errors="replace"))]

    def mark(self) -> int:
        return len(self.requests())

    def object_requests(self, since: int, method: str) -> list[str]:
        """The paths of `method` requests on store objects (`.../objects/<sha256>`) after `since`."""
        return [path for m, path, status in self.requests()[since:]
                if m == method and "/objects/" in path and status < 300]


@contextmanager
def s3_server(folder: Path) -> Iterator[S3Server]:
    log = folder / "moto.log"
    timeout = shutil.which("timeout")
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"]
    with open(log, "w") as out:
        process = subprocess.Popen([timeout, str(LIFETIME_S), *command] if timeout else command, stdout=out,
                                   stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while not (match := _RUNNING.search(log.read_text(errors="replace"))):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield S3Server(match[1], log)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
