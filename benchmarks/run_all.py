"""Run every benchmark in this folder (`make bench`). Extra arguments go to each, e.g. `--rows 2000` for a quick run.

A benchmark is a module here with `main(argv: list[str] | None) -> int`; add its name to BENCHMARKS.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = ("analyze_speed",)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    failed = 0
    for name in BENCHMARKS:
        print(f"== {name}", flush=True)
        failed += bool(importlib.import_module(name).main(list(argv)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
