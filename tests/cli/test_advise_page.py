"""`shapeplan advise --html`, through the console script: a page for a design review. The recommended row is marked,
every row's flags and the baseline's command are there unbroken and copyable, the baseline's dataset and settings
are shown, GRPO's shapes carry their cache length and new tokens (no two rows alike); and rendered in a real headless
Chromium, no flag wraps and the labels are readable."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html import unescape
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_exit_codes import SHAPEPLAN
from tests.conftest import ROOT, TINY_MODEL, TLDR

NS = {"h": "http://www.w3.org/1999/xhtml"}
ARGS = ["--method", "grpo", str(TLDR), "--model", str(TINY_MODEL)]


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """The GRPO advice page and the same advice as JSON, from one `advise` run."""
    folder = tmp_path_factory.mktemp("advise")
    html_file = folder / "advice.html"
    done = subprocess.run([SHAPEPLAN, "advise", *ARGS, "--json", "--html", str(html_file)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "SHAPEPLAN_CACHE_DIR": str(folder / "cache")},
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return html_file.read_text(), json.loads(done.stdout)


def _text(element: ET.Element) -> str:
    return "".join(element.itertext())


def _table(root: ET.Element, name: str) -> tuple[list[str], list[list[str]], list[ET.Element]]:
    table = root.find(f".//h:table[@class='{name}']", NS)
    assert table is not None, name
    headers = [_text(th) for th in table.findall("h:thead/h:tr/h:th", NS)]
    rows = table.findall("h:tbody/h:tr", NS)
    return headers, [[_text(td) for td in tr.findall("h:td", NS)] for tr in rows], rows


def test_the_page_marks_the_recommendation_and_keeps_every_command_whole(page: tuple[str, dict[str, Any]]) -> None:
    html, advice = page
    root = ET.fromstring(html.split("\n", 1)[1])
    headers, rows, elements = _table(root, "what-if")
    flags = headers.index("TRL flags")
    recommended = [cells for cells, tr in zip(rows, elements, strict=True) if tr.get("class") == "recommended"]
    assert advice["recommended"] and len(recommended) == 1
    assert shlex.split(recommended[0][flags]) == advice["recommended"]
    # each alternative's flags are one <code> element holding exactly its argv
    codes = [tr.findall("h:td", NS)[flags].find("h:code", NS) for tr in elements[1:]]
    assert [shlex.split(_text(code)) for code in codes if code is not None] == \
        [option["flags"] for option in advice["alternatives"]]

    # the baseline's command pastes into a shell as one command: `trl grpo`, the baseline's own options, then what
    # makes it run as printed (the local file as a dataset folder, a placeholder reward); the recommendation's adds
    # its flags last
    blocks = root.findall(".//h:pre[@class='command']", NS)
    commands = [shlex.split(_text(pre).replace("\\\n", "")) for pre in blocks]
    assert advice["command"] in commands and advice["recommended_command"] in commands
    given = advice["argv"]
    where = given.index("--dataset_name") + 1
    assert advice["command"][:2 + len(given)] == ["trl", "grpo", *given[:where], advice["command"][2 + where],
                                                  *given[where + 1:]]
    assert advice["command"][2 + where] != str(TLDR)  # the data file, as a dataset folder TRL reads
    flags, head = advice["recommended"], advice["recommended_command"][:-len(advice["recommended"])]
    assert advice["recommended_command"][-len(flags):] == flags  # the change, last, replacing the same options
    assert set(zip(head[2::2], head[3::2], strict=True)) <= \
        set(zip(advice["command"][2::2], advice["command"][3::2], strict=True))
    assert "--reward_funcs" in advice["command"] and "placeholder" in advice["notes"][0]
    settings = {_text(th): _text(td) for tr in root.findall(".//h:table[@class='settings']/h:tbody/h:tr", NS)
                for th, td in zip(tr.findall("h:th", NS), tr.findall("h:td", NS), strict=True)}
    assert settings["dataset"] == str(TLDR) and settings["model"] == str(TINY_MODEL)
    assert settings["method"] == "grpo" and settings["per_device_train_batch_size"] == "4"


def test_grpo_shapes_show_their_generate_sizes_so_no_two_rows_are_alike(page: tuple[str, dict[str, Any]]) -> None:
    html, advice = page
    root = ET.fromstring(html.split("\n", 1)[1])
    headers, rows, _ = _table(root, "shapes")
    assert {"cache length", "new tokens"} <= set(headers)
    baseline = advice["baseline"]["shapes"]
    assert len(rows) == len(baseline)
    generate = [row for row in rows if row[0] == "generate"]
    assert generate and len({(r[1], r[2]) for r in generate}) < len(generate)  # same (batch, seq), other sizes
    keys = [tuple(row[:headers.index("count")]) for row in rows]
    assert len(set(keys)) == len(keys)
    cache = headers.index("cache length")
    assert [int(r[cache]) for r in generate] == [s["cache_len"] for s in baseline if s["phase"] == "generate"]


# Runs in the browser after layout: what a reader sees, written into the DOM that --dump-dom prints.
_MEASURE = """<script>
const lines = el => { const r = document.createRange(); r.selectNodeContents(el);
  return new Set([...r.getClientRects()].map(x => Math.round(x.top))).size; };
const flagCells = [...document.querySelectorAll("table.what-if td code")];
const flagColumn = document.querySelector("table.what-if td code").parentElement;
const result = {
  flags: flagCells.length,
  wrapped_flags: flagCells.filter(c => lines(c) > 1).map(c => c.textContent),
  command_spacing: [...new Set([...document.querySelectorAll("pre.command")].map(p => getComputedStyle(p).whiteSpace))],
  flag_align: getComputedStyle(flagColumn).textAlign,
  recommended_bg: getComputedStyle(document.querySelector("tr.recommended td")).backgroundColor,
  plain_bg: getComputedStyle(document.querySelector("table.what-if tbody tr:not([class]) td")).backgroundColor,
  label_px: Math.min(...[...document.querySelectorAll("svg text")].map(t => t.getBBox().height)),
};
document.body.setAttribute("data-measured", JSON.stringify(result));
</script></body>"""


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium (`make browser` installs Debian's)")
def test_in_headless_chromium_no_flag_wraps_and_labels_are_readable(page: tuple[str, dict[str, Any]],
                                                                      tmp_path: Path) -> None:
    html, _ = page
    measured = tmp_path / "measured.html"
    measured.write_text(html.replace("</body>", _MEASURE))
    done = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1000,900",
                           "--dump-dom", measured.as_uri()], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    start = done.stdout.index('data-measured="') + len('data-measured="')
    result = json.loads(unescape(done.stdout[start:done.stdout.index('"', start)]))
    assert result["flags"] > 0 and result["wrapped_flags"] == []  # a narrow window scrolls the table instead
    assert result["command_spacing"] == ["pre"]  # commands keep their lines; a long one scrolls
    assert result["flag_align"] in ("left", "start")
    assert result["recommended_bg"] != result["plain_bg"]
    assert result["label_px"] >= 12
