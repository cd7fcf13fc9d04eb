"""``hybrid-data``'s ``use:`` line trains when pasted into ``hybrid-train``, for every output
format (slow: a process each); a file given to the wrong data source is named for what it is,
with the setting that reads it (``hybrid/data/file_kinds.py``); the data settings' advice
names the data group (fast, in-process)."""

import gzip
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launch.commands.app import compose_train_config
from tests.refusals import refusal_in_process

BIN = Path(sys.executable).parent
TINY = ["model=tiny", "parallel=single", "train.steps=2", "train.global_batch=2",
        "train.micro_batch=1", "train.log_every=100", "train.timeline_step=0"]


def paragraphs(path: Path, count: int) -> Path:
    words = "the quick brown fox jumps over a lazy dog while cats sleep".split()
    path.write_text("\n\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(120))
                                for i in range(count)))
    return path


def use_line(tmp_path: Path, *args: str) -> list[str]:
    done = subprocess.run([str(BIN / "hybrid-data"), *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    use = [line for line in done.stdout.splitlines() if line.startswith("use: ")]
    assert len(use) == 1, done.stdout
    return shlex.split(use[0][len("use: "):])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt, documents, evaluates", [
    ("tokens", "file", False), ("indexed", "file", False), ("indexed", "blank-lines", True)])
def test_the_printed_use_line_trains_when_pasted(tmp_path, fmt, documents, evaluates):
    text = paragraphs(tmp_path / "in.txt", 300)
    line = use_line(tmp_path, str(text), str(tmp_path / "out"), "--format", fmt,
                    "--documents", documents)
    assert line[0] == f"data={fmt}", line
    # one document leaves the indexed validation part empty: evaluation off; tokens have none
    assert ("eval.every=0" in line) == (fmt == "indexed" and not evaluates), line
    done = subprocess.run([str(BIN / "hybrid-train"), *line, *TINY,
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "over 2 steps" in done.stdout + done.stderr
    assert ("eval_loss" in done.stdout + done.stderr) == evaluates


def _wrong(tmp_path: Path, source: str, name: str, content: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return refusal_in_process([*TINY, f"data={source}", f"data.path={path}"], tmp_path / "run")


@pytest.mark.parametrize("name, content, said", [
    ("in.parquet", b"PAR1" + bytes(64) + b"PAR1", "is a Parquet file, not tokens"),
    ("in.txt.zst", b"\x28\xb5\x2f\xfd" + bytes(64), "is a zstd-compressed file, not tokens"),
    ("in.txt.gz", gzip.compress(b"hello " * 100, mtime=0), "is a gzip-compressed file, not tokens"),
])
@pytest.mark.parametrize("source", ["tokens", "indexed"])
def test_an_input_file_given_as_data_says_what_it_is_and_to_tokenize_it(tmp_path, name, content,
                                                                        said, source):
    line = _wrong(tmp_path, source, name, content)
    assert said in line and f"`hybrid-data {tmp_path / name} OUTPUT`" in line, line
    assert "vocab" not in line, line


def test_each_half_of_an_indexed_pair_points_to_its_prefix(tmp_path):
    text = paragraphs(tmp_path / "in.txt", 20)
    subprocess.run([str(BIN / "hybrid-data"), str(text), str(tmp_path / "pair"), "--format",
                    "indexed"], check=True, capture_output=True, timeout=120)
    idx = refusal_in_process([*TINY, "data=tokens", f"data.path={tmp_path}/pair.idx"],
                             tmp_path / "run")
    assert f"is a Megatron index (PREFIX.idx), not a token file; it is read with its .bin " \
           f"by data=indexed data.path={tmp_path}/pair" in idx, idx
    half = refusal_in_process([*TINY, "data=indexed", f"data.path={tmp_path}/pair.bin"],
                              tmp_path / "run")
    assert half.endswith(f"takes the PREFIX without extension: data.path={tmp_path}/pair"), half


def test_a_token_file_given_to_data_indexed_names_data_tokens(tmp_path):
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(bytes(range(200)) * 40)
    line = refusal_in_process([*TINY, "data=indexed", f"data.path={tokens}"], tmp_path / "run")
    assert line.endswith(f"is read by data=tokens data.path={tokens}"), line
    assert "data=indexed data.path" not in line, line


def test_a_data_source_alone_is_told_to_choose_the_data_group(tmp_path):
    line = refusal_in_process([*TINY, "data.source=tokens", "data.path=x.bin"], tmp_path)
    assert "choose the data group whole with data=tokens (no data.example), or set " \
           "data.example=null" in line, line
    for advice in (["data=tokens"], ["data.source=tokens", "data.example=null"]):
        assert compose_train_config([*TINY, *advice, "data.path=x.bin"]).data.example is None
