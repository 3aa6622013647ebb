"""Where the test suite's time goes, from the JUnit XML of one whole run.

    .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --junitxml=run.xml
    .venv/bin/python scripts/test_durations.py run.xml

writes tests/durations.json (each file's seconds: the order in which `make test` hands files to the workers, see
tests/conftest.py) and prints the tables docs/development.md records: seconds per folder and the 30 slowest tests.
Each test's time is its setup, call and teardown, so a module fixture's cost counts towards its file's first test.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_seconds(junit: Path) -> dict[str, float]:
    """Each test's node id (tests/path.py::name[param]) and seconds."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        # classname is the module's dotted path, with a test class's name after it where there is one
        path = next((Path(*parts[:i]).with_suffix(".py") for i in range(len(parts), 0, -1)
                     if (ROOT / Path(*parts[:i]).with_suffix(".py")).is_file()), None)
        if path is None:
            continue
        rest = parts[len(path.with_suffix("").parts):]
        node = "::".join([path.as_posix(), *rest, case.get("name", "")])
        seconds[node] = seconds.get(node, 0.0) + float(case.get("time", 0))
    return seconds


def main(junit: Path) -> None:
    seconds = test_seconds(junit)
    files: dict[str, float] = defaultdict(float)
    folders: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for node, value in seconds.items():
        path = node.split("::")[0]
        files[path] += value
        folder = str(Path(path).parent)
        folders[folder] += value
        counts[folder] += 1
    (ROOT / "tests" / "durations.json").write_text(
        json.dumps({k: round(v, 1) for k, v in sorted(files.items(), key=lambda kv: -kv[1])}, indent=1) + "\n")
    total = sum(seconds.values())
    print(f"{len(seconds)} tests, {total:.0f} s of test time\n")
    print("| folder | tests | seconds | share |\n|---|---:|---:|---:|")
    for folder, value in sorted(folders.items(), key=lambda kv: -kv[1]):
        print(f"| `{folder}` | {counts[folder]} | {value:.0f} | {value / total:.0%} |")
    print("\n| test | seconds |\n|---|---:|")
    for node, value in sorted(seconds.items(), key=lambda kv: -kv[1])[:30]:
        print(f"| `{node}` | {value:.0f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
