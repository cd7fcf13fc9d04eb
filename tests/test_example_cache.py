"""The built-in corpus is built once per machine, into the user's cache, safely by runs that
start together, and a cache it cannot write is one line before launch (#43)."""

import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.data.examples import write_example
from hybrid.data.fingerprint import fingerprint
from hybrid.data.metadata import read_meta

TRAIN = str(Path(sys.executable).parent / "hybrid-train")

pytestmark = pytest.mark.timeout(180)


def _build(folder: str, start, out) -> None:
    start.wait(60)  # both builders released together
    out.put(write_example("python-docs", Path(folder)))


def test_two_runs_building_the_corpus_at_once_both_read_it_whole(tmp_path):
    context = mp.get_context("spawn")
    start, out = context.Event(), context.Queue()
    procs = [context.Process(target=_build, args=(str(tmp_path), start, out)) for _ in range(2)]
    for proc in procs:
        proc.start()
    try:
        start.set()
        results = [out.get(timeout=150) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    (prefix,) = {prefix for prefix, _ in results}
    assert read_meta(prefix)["format"] == "indexed"
    assert sorted(p.name for p in (tmp_path / "examples").iterdir()) == [
        Path(prefix).name + suffix for suffix in (".bin", ".idx", ".meta.json")]  # no leftovers
    again, built = write_example("python-docs", tmp_path)
    assert (again, built) == (prefix, False)  # built once, then read
    files = [prefix + ".bin", prefix + ".idx"]
    before = fingerprint(files)
    other, _ = write_example("python-docs", tmp_path / "elsewhere")
    after = fingerprint([other + ".bin", other + ".idx"])
    assert [(f["bytes"], f["edges_sha256"]) for f in before] == \
        [(f["bytes"], f["edges_sha256"]) for f in after]  # the same bytes wherever built


def test_a_cache_that_cannot_be_written_is_one_line_before_launch(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = subprocess.run([TRAIN, "parallel=single", "model=tiny",
                           f"data.cache_dir={blocker / 'cache'}",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot build the built-in corpus "
                                                   "python-docs into "), lines
    assert "data.cache_dir=DIR" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing left behind
