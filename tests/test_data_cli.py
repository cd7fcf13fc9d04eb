"""``hybrid-data`` through the installed console script: output, errors, atomic writes."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hybrid.data.readers
from hybrid.data.prepare import Request, prepare_data
from hybrid.planning.config import DataConfig, ModelConfig, TrainConfig
from hybrid.data import make_dataset, validate_data

HYBRID_DATA = str(Path(sys.executable).parent / "hybrid-data")
TEXT = "Ünïcödé and plain ASCII: the quick brown fox jumps over the lazy dog. " * 20

pytestmark = pytest.mark.timeout(60)


def _run(*args):
    return subprocess.run([HYBRID_DATA, *map(str, args)], capture_output=True, text=True,
                          timeout=30)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_tokens_round_trip_through_make_dataset(tmp_path, dtype):
    source, output = tmp_path / "in.txt", tmp_path / "tokens.bin"
    source.write_text(TEXT, encoding="utf-8")
    data = TEXT.encode("utf-8")
    result = _run(source, output, *([] if dtype == "uint16" else ["--dtype", dtype]))
    assert result.returncode == 0, result.stderr
    assert f"wrote {len(data)} tokens of 1 document ({dtype}, bytes, vocab 256)" in result.stdout
    assert f"use: data=tokens data.path={output} data.dtype={dtype}" in result.stdout
    assert output.stat().st_size == len(data) * np.dtype(dtype).itemsize

    data_cfg, model_cfg = DataConfig(source="tokens", path=str(output), dtype=dtype), \
        ModelConfig(vocab=256, seq_len=32)
    assert validate_data(data_cfg, model_cfg, TrainConfig(global_batch=8)) == (len(data) - 1) // 32
    dataset = make_dataset(data_cfg, model_cfg, seed=0)
    # Windows overlap by one token (stride seq_len): stitch them back into the text.
    stitched = [int(t) for t in dataset[0]]
    for i in range(1, len(dataset)):
        stitched.extend(int(t) for t in dataset[i][1:])
    assert bytes(stitched) == data[:len(stitched)]
    assert len(data) - len(stitched) < 32


def test_missing_input_exits_2_with_one_line(tmp_path):
    output = tmp_path / "tokens.bin"
    result = _run(tmp_path / "nope.txt", output)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: input file") and "does not exist" in result.stderr
    assert not output.exists()


def test_failed_rename_leaves_no_partial_file(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text(TEXT)
    blocker = tmp_path / "out.bin"
    blocker.mkdir()  # os.replace of a file onto a folder fails after the data is written
    result = _run(source, blocker)
    assert result.returncode == 2 and result.stderr.startswith("error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.bin"]


def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    source, output = tmp_path / "in.txt", tmp_path / "tokens.bin"
    source.write_text(TEXT)
    output.write_bytes(b"old")
    monkeypatch.setattr(hybrid.data.readers, "CHUNK_BYTES", 64)

    def fail_fsync(fd):
        raise KeyboardInterrupt  # as if Ctrl-C arrived after part of the data was written

    monkeypatch.setattr(os, "fsync", fail_fsync)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(Request(inputs=[str(source)], output=str(output), force=True,
                             progress=False))
    assert output.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "tokens.bin"]


def test_empty_input_and_missing_output_folder_are_user_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = _run(empty, tmp_path / "t.bin")
    assert result.returncode == 2 and "is empty" in result.stderr
    source = tmp_path / "in.txt"
    source.write_text(TEXT)
    result = _run(source, tmp_path / "missing" / "t.bin")
    assert result.returncode == 2 and "output folder" in result.stderr


def test_an_output_folder_that_takes_no_files_is_named_not_a_temporary_file(tmp_path):
    """/proc takes no new file, even from root (chmod would not stop the tests' root)."""
    from hybrid.data.prepare import OutputError

    source = tmp_path / "in.txt"
    source.write_text(TEXT)
    with pytest.raises(OutputError) as refused:
        prepare_data(Request(inputs=[str(source)], output="/proc/tokens.bin", progress=False))
    message = str(refused.value)
    assert message.startswith("cannot write /proc/tokens.bin in the folder /proc (")
    assert "choose a folder you can write to" in message and ".tmp" not in message


def test_workers_beyond_the_cores_are_capped_with_a_warning(monkeypatch, capsys):
    import launch.commands.data

    monkeypatch.setattr(launch.commands.data, "usable_cores", lambda: 3)
    assert launch.commands.data._workers(2) == 2 and capsys.readouterr().err == ""
    assert launch.commands.data._workers(1000) == 3
    assert capsys.readouterr().err == ("warning: --workers 1000 is more than the 3 cores this "
                                       "process may use; tokenizing with 3 workers\n")


@pytest.mark.slow
def test_workers_beyond_the_cores_through_the_command(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text(TEXT)
    one = _run(source, tmp_path / "one.bin", "--quiet")
    many = _run(source, tmp_path / "many.bin", "--quiet", "--workers", "1000")
    assert one.returncode == 0 and many.returncode == 0, many.stderr
    cores = len(os.sched_getaffinity(0))
    assert many.stderr == (f"warning: --workers 1000 is more than the {cores} cores this "
                           f"process may use; tokenizing with {cores} workers\n")
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "many.bin").read_bytes()
