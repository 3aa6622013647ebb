"""What `shapeplan cache pull` transfers from an S3 store: a first pull against a second pull of the same store, and
`pull --plan` of a plan whose pushes make up half the store.

Against a real S3 server on loopback (moto's standalone server, as the tests start it), through the console script
a user runs. Two cache dirs of the same size are pushed: one holding the shapes of a real plan (the bundled sample
data), one holding another plan's. Prints per pull the objects and bytes downloaded (counted in the server's request
log), the manifests read, and the wall time.

    python benchmarks/store_pull.py [--files 200] [--kib 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shapeplan.plan.io import write_plan  # noqa: E402
from shapeplan.services.run import plan_tasks  # noqa: E402
from tests.cache.s3_server import S3Server, s3_server  # noqa: E402
from tests.cache.test_store import _bigger_cache  # noqa: E402
from tests.conftest import CAPYBARA  # noqa: E402
from tests.warm.harness import plan_for  # noqa: E402

SHAPEPLAN = str(Path(sys.executable).parent / "shapeplan")


def _shapeplan(*args: str | Path) -> tuple[dict, float]:
    start = time.perf_counter()
    proc = subprocess.run([SHAPEPLAN, *map(str, args), "--json"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    if proc.returncode != 0:
        sys.exit(f"failed: shapeplan {' '.join(map(str, args))}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), time.perf_counter() - start


def _pull(server: S3Server, label: str, *args: str | Path) -> None:
    mark = server.mark()
    result, seconds = _shapeplan("cache", "pull", *args)
    objects = server.object_requests(mark, "GET")
    manifests = [p for m, p, s in server.requests()[mark:] if m == "GET" and p.endswith(".json") and s < 300]
    print(f"{label:<28} {len(objects):>8} {result['downloaded_bytes']:>12} {len(manifests):>10} {seconds:>9.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200, help="files per pushed cache dir")
    parser.add_argument("--kib", type=int, default=64, help="size of each file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shapeplan-store-bench-") as folder:
        tmp = Path(folder)
        with s3_server(tmp) as server:
            os.environ.update(server.env())
            import s3fs

            bucket = f"bench{uuid.uuid4().hex[:8]}"
            s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
            url = f"s3://{bucket}/shapeplan"
            plan = tmp / "plan.json"
            write_plan(plan_for("sft", CAPYBARA, ["--max_length", "128", "--per_device_train_batch_size", "2"],
                                tmp / "out"), plan)
            keys = tuple(t.key for t in plan_tasks(str(plan), "cpu"))
            for name, shapes in (("mine", keys), ("other", ("train 64x4096",))):
                cache = _bigger_cache(tmp / name, files=args.files, size=args.kib * 1024, shapes=shapes)
                _shapeplan("cache", "push", "--cache-dir", cache, url)
            print(f"store: 2 pushes of {args.files} files x {args.kib} KiB ({url} on {server.endpoint})")
            print(f"{'pull':<28} {'objects':>8} {'bytes':>12} {'manifests':>10} {'wall s':>9}")
            _pull(server, "first pull (whole store)", url, "--cache-dir", tmp / "fresh")
            _pull(server, "second pull (unchanged)", url, "--cache-dir", tmp / "fresh")
            _pull(server, "pull --plan (half the store)", url, "--cache-dir", tmp / "plan-only", "--plan", plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
