"""Run every benchmark in this folder with its defaults (`make bench`), or one with its own arguments:
`python benchmarks/run_all.py analyze_speed --rows 2000`.

A benchmark is a module here with `main(argv: list[str] | None) -> int`; add its name to BENCHMARKS.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = ("analyze_speed", "analyze_floor", "advise_speed", "stream_rows", "warm_speedup", "warm_overhead",
              "guard_overhead", "fleet_balance", "store_pull", "typo_speed", "bounded_work")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if argv and argv[0] not in BENCHMARKS:
        print(f"unknown benchmark {argv[0]!r}; choose one of {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    chosen = [(argv[0], argv[1:])] if argv else [(name, []) for name in BENCHMARKS]
    failed = 0
    for name, args in chosen:
        print(f"== {name}", flush=True)
        failed += bool(importlib.import_module(name).main(args))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
