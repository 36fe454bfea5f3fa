"""The README's and `docs/`'s examples run, and their links lead somewhere (issue 43 item 6).

A fenced block whose info string is `bash test` or `python test` is run: bash blocks with
`bash -e -o pipefail` from the repository's root (the venv's `bin/` first on PATH, so
`treadle` and `python` are the venv's; `curl` fails on an HTTP error), python blocks with this
interpreter. Both run against one `treadle serve` of the default model for the whole module:
`127.0.0.1:8000` in a block becomes that server's address. Every other `bash` or `python`
block must be in NOT_RUN (or its page in NOT_RUN_PAGES) with the reason it cannot run here,
so a new example is run unless someone says why not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from serve_helpers import RemoteServer

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ADDRESS = "127.0.0.1:8000"
"""What the examples call the server; the test's own server replaces it."""

NOT_RUN = {
    "make serve ": "installs, then serves until stopped",
    "source .venv/bin/activate": "serves until stopped",
    "make test ": "the whole suite (~20 min)",
    "treadle bench serve --backend openai-chat --dataset-name sharegpt": "needs ShareGPT's file",
    "head -c 32 /dev/urandom": "two hosts",
}
"""The first words of a block that is not run -> why."""
NOT_RUN_PAGES = {
    "docs/images.md": "needs a LLaVA directory and image files, not the default text model",
    "docs/lora.md": "needs adapter directories (peft makes them in tests/entrypoints/)",
}
"""A page none of whose blocks run -> why (its examples are left to a test of their own)."""

FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```$", re.M | re.S)
CURL_FAILS = (
    'curl() { case " $* " in *" -sf "*|*" -f "*|*" --fail "*) command curl "$@";; '
    '*) command curl --fail-with-body "$@";; esac; }\n'
)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    run: bool
    code: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> Iterator[Block]:
    for path in PAGES:
        text = path.read_text()
        for m in FENCE.finditer(text):
            lang, info, code = m.group(1), m.group(2).split(), m.group(3)
            if lang in ("bash", "python"):
                line = text.count("\n", 0, m.start()) + 1
                yield Block(path.relative_to(ROOT).as_posix(), line, lang, "test" in info, code)


RUN = [b for b in blocks() if b.run]


def test_every_example_is_run_or_says_why_not() -> None:
    unmarked = [
        f"{b}: {b.code.splitlines()[0]!r}"
        for b in blocks()
        if not b.run
        and b.page not in NOT_RUN_PAGES
        and not any(b.code.lstrip().startswith(k) for k in NOT_RUN)
    ]
    assert not unmarked, "fence these as `bash test` / `python test`, or say why in NOT_RUN:\n" + (
        "\n".join(unmarked)
    )
    assert len(RUN) >= 10
    first_lines = [b.code.lstrip() for b in blocks() if not b.run and b.page not in NOT_RUN_PAGES]
    stale = [k for k in NOT_RUN if not any(c.startswith(k) for c in first_lines)]
    assert not stale, f"no such block now, delete from NOT_RUN: {stale}"


def test_the_readme_stays_a_front_door() -> None:
    """At most 250 lines (issue 43): the rest belongs in a page of `docs/`."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move a section into docs/"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_leads_to_a_file() -> None:
    broken = []
    for path in PAGES:
        for m in LINK.finditer(path.read_text()):
            target = m.group(1).split("#")[0]
            if not target or re.match(r"[a-z]+:", target):
                continue  # an anchor on this page, or http(s):, mailto:
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {m.group(1)}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    server = RemoteServer([], tmp_path_factory.mktemp("docs-server"))
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("block", RUN, ids=str)
def test_example_runs(block: Block, server: RemoteServer, tmp_path: Path) -> None:
    code = block.code.replace(ADDRESS, server.url.removeprefix("http://"))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if block.lang == "bash":
        command = ["bash", "-e", "-o", "pipefail", "-c", CURL_FAILS + code]
        cwd = ROOT
    else:
        script = tmp_path / "example.py"
        script.write_text(code)
        command, cwd = [sys.executable, str(script)], tmp_path
    start = time.monotonic()
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    took = time.monotonic() - start
    assert done.returncode == 0, (
        f"{block} exited {done.returncode} after {took:.1f} s\n--- code\n{code}\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    )
    if block.lang == "python":
        assert done.stdout.strip(), f"{block} printed nothing"
