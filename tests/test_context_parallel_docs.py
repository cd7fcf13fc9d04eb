"""docs/context-parallel.md's search results stay true: each ``hybrid-plan`` command the page
shows is run, and the row and the ``why cp=`` line the page quotes after it are in its output
(about 3 s each)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PAGE = ROOT / "docs" / "context-parallel.md"


def shown() -> list[tuple[str, list[str]]]:
    """(command, the quotes after it up to the next command: a result row, a why line)."""
    text = PAGE.read_text()
    parts = re.split(r"```\n(hybrid-plan [^\n]*)\n```", text)
    return [(command, re.findall(r"`((?:\d+ {2,}|why cp=)[^`]*)`", " ".join(after.split("\n"))))
            for command, after in zip(parts[1::2], parts[2::2])]


def test_the_page_shows_both_searches():
    commands = [command for command, _ in shown()]
    assert [re.search(r"model.seq_len=(\d+)", c)[1] for c in commands] == ["524288", "32768"]
    assert all(len(quotes) == 2 for _, quotes in shown()), shown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command, quotes", shown(),
                         ids=[re.search(r"seq_len=(\d+)", c)[1] for c, _ in shown()])
def test_the_pages_search_results_are_what_hybrid_plan_prints(command, quotes, tmp_path):
    args = shlex.split(command)
    done = subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True,
                          timeout=100, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [" ".join(line.split()) for line in done.stdout.splitlines()]
    for quote in quotes:  # a row whole, a why line's start
        assert any(line.startswith(" ".join(quote.split())) for line in printed), \
            (quote, done.stdout)
