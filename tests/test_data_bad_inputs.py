"""Bad data through the real commands: each is one line and exit status 2, before any worker
starts (``hybrid-train``) or with nothing written (``hybrid-data``)."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pydoc_data.topics
import pytest
from refusals import refusal_in_process

BIN = Path(sys.executable).parent
TRAIN, DATA = str(BIN / "hybrid-train"), str(BIN / "hybrid-data")
SMALL = ["model=tiny", "parallel=single", "train.global_batch=8", "train.steps=2",
         "train.timeline_step=0", "optim.warmup_steps=0", "data=indexed"]
TEXT = "\n\n".join(pydoc_data.topics.topics.values())  # ~2,600 paragraphs of real text

pytestmark = pytest.mark.timeout(120)


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=100,
                          **kwargs)


def one_line(done: subprocess.CompletedProcess, needle: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert needle in lines[0], lines[0]


def make(folder: Path, name: str, text: str, *args) -> Path:
    source = folder / f"{name}.txt"
    source.write_text(text, encoding="utf-8")
    done = run([DATA, source, folder / name, "--format", "indexed", "--documents", "blank-lines",
                "--quiet", *args])
    assert done.returncode == 0, done.stderr
    return folder / name


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """Good data sets, and damaged copies of one, each named by what is wrong with it."""
    folder = tmp_path_factory.mktemp("data")
    good = make(folder, "good", TEXT)
    sets = {"good": good, "gpt2": make(folder, "gpt2", TEXT[:20000], "--tokenizer", "gpt2"),
            "five": make(folder, "five", "\n\n".join(["a short document"] * 5))}
    for damage in ("no_bin", "no_idx", "short_bin", "magic", "version", "uint16_vocab70000",
                   "pointer"):
        copy = folder / damage
        for suffix in (".bin", ".idx", ".meta.json"):
            shutil.copy(f"{good}{suffix}", f"{copy}{suffix}")
        sets[damage] = copy
    Path(f"{sets['no_bin']}.bin").unlink()
    Path(f"{sets['no_idx']}.idx").unlink()
    with open(f"{sets['short_bin']}.bin", "r+b") as handle:
        handle.truncate(handle.seek(0, 2) - 2)
    _patch(f"{sets['magic']}.idx", 0, b"TNTIDX\x00\x00\x00")
    _patch(f"{sets['version']}.idx", 9, bytes([2]))
    sequences = int.from_bytes(Path(f"{good}.idx").read_bytes()[18:26], "little")
    last_pointer = 34 + 4 * sequences + 8 * (sequences - 1)  # the header is 34 bytes
    _patch(f"{sets['pointer']}.idx", last_pointer, (10**12).to_bytes(8, "little"))
    sets["last"] = sequences - 1
    meta_path = Path(f"{sets['uint16_vocab70000']}.meta.json")
    meta = json.loads(meta_path.read_text())
    meta["tokenizer"]["vocab_size"] = 70000
    meta_path.write_text(json.dumps(meta))
    return sets


def _patch(path: str, offset: int, content: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(content)


TRAIN_CASES = [
    ("missing .bin", ["data.path={no_bin}"], "no_bin.bin does not exist"),
    ("missing .idx", ["data.path={no_idx}"], "no_idx.idx does not exist"),
    (".bin size", ["data.path={short_bin}"], "short_bin.bin has"),
    ("magic", ["data.path={magic}"], "is not a Megatron index"),
    ("pointer past the end", ["data.path={pointer}"],
     "{pointer}.idx: sequence {last} points to byte 1000000000000 of {pointer}.bin ("),
    ("version", ["data.path={version}"], "is MMIDIDX version 2; hybrid and megatron-core read"),
    ("dtype", ["data.path={uint16_vocab70000}", "model.vocab=70000"],
     "stores uint16 tokens but was tokenized with bytes (vocabulary 70000)"),
    ("vocab", ["data.path={gpt2}"],
     "was tokenized with gpt2 (vocabulary 50257) but model.vocab=256; set model.vocab=50257"),
    ("zero weight", ["data.blend=[0,{good},1,{five}]"], "data.blend weight 0 (of"),
    ("negative weight", ["data.blend=[-0.5,{good},1,{five}]"], "data.blend weight -0.5"),
    ("nan weight", ["data.blend=[nan,{good},1,{five}]"], "data.blend weight nan"),
    ("odd blend", ["data.blend=[0.7,{good},0.3]"], "has 3 items; it alternates weight and prefix"),
    ("two parts", ["data.path={good}", "data.split=[9,1]"], "must be three non-negative numbers"),
    ("negative part", ["data.path={good}", "data.split=[9,-1,1]"], "must be three non-negative"),
    ("no train part", ["data.path={good}", "data.split=[0,1,1]"], "with a positive train part"),
    ("empty split", ["data.path={five}", "eval.every=1"],
     "data.split=[969,30,1] leaves the validation part of {five} empty: its 5 documents split "
     "train 5, validation 0, test 0; use data.split=[4,1,0], or evaluate nothing "
     "(eval.every=0 eval.at_end=false)"),
    ("two tokenizers", ["data.blend=[1,{good},1,{gpt2}]", "model.vocab=50257"],
     "data.blend mixes data sets made with different tokenizers"),
    ("path and blend", ["data.path={good}", "data.blend=[1,{good}]"],
     "data.path and data.blend both name data"),
]


@pytest.mark.parametrize("name, overrides, needle", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_bad_indexed_data_is_one_line_before_any_worker(name, overrides, needle, data, tmp_path):
    """Decided in-process by hybrid-train's own checks (``refusals``); the command itself
    says the same for two of them (below)."""
    line = refusal_in_process([*SMALL, *(o.format(**data) for o in overrides)], tmp_path)
    assert needle.format(**data) in line, line
    assert not any(tmp_path.iterdir())  # no config.json, no data cache, no worker directory


@pytest.mark.parametrize("name", ["pointer past the end", "empty split"])
def test_the_command_refuses_bad_data_with_the_same_line(name, data, tmp_path):
    overrides = next([o.format(**data) for o in case[1]] for case in TRAIN_CASES
                     if case[0] == name)
    expected = refusal_in_process([*SMALL, *overrides], tmp_path / "in-process")
    run_dir = tmp_path / "run"
    done = run([TRAIN, *SMALL, *overrides, f"hydra.run.dir={run_dir}"])
    one_line(done, expected.removeprefix("error: "))
    assert done.stderr.strip() == expected
    assert not run_dir.exists()  # nothing kept: no config.json, no data cache, no workers


def test_nan_and_inf_weights_are_refused_by_the_check_itself():
    from hybrid.planning.config import DataConfig
    from hybrid.planning.data_sources import data_problem

    for weight in (math.inf, math.nan, "x", True):
        problem = data_problem(DataConfig(source="indexed", blend=[weight, "a", 1, "b"]))
        assert problem and "must be a positive finite number" in problem


def _wide_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(70000)} | {"<|endoftext|>": 70000}
    Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")).save(str(path))
    return path


def _files(folder: Path) -> dict:
    folder.mkdir(exist_ok=True)
    (folder / "ok.txt").write_text("fine text\n")
    (folder / "bad.jsonl").write_text('{"text": "one"}\n{"text": "two",\n')
    (folder / "other_key.jsonl").write_text('{"body": "one"}\n')
    (folder / "not_text.jsonl").write_text('{"text": ["a", "list"]}\n')
    (folder / "latin1.txt").write_bytes("line one\nline two\ncaf\u00e9\n".encode("latin-1"))
    (folder / "exists.bin").write_bytes(b"old")
    elf = folder / "program"  # a real executable: the kind of file a glob like 'src/**/*' meets
    shutil.copy(os.path.realpath(shutil.which("true")), elf)
    assert elf.read_bytes().startswith(b"\x7fELF")
    return {"dir": folder, "wide": _wide_tokenizer(folder / "wide.json"), "elf": elf}


DATA_CASES = [
    ("not JSON", ["{dir}/bad.jsonl", "{dir}/out"], "bad.jsonl:2: not JSON"),
    ("no key", ["{dir}/other_key.jsonl", "{dir}/out"],
     "other_key.jsonl:1: no key 'text' (found: body); pass --json-key KEY"),
    ("not a string", ["{dir}/not_text.jsonl", "{dir}/out"], "'text' holds a list, not a string"),
    ("not UTF-8", ["{dir}/latin1.txt", "{dir}/out", "--tokenizer", "gpt2"],
     "latin1.txt:3 (byte offset 21): byte b'\\xe9' is not UTF-8; convert the file to UTF-8, "
     "or pass --encoding-errors replace"),
    ("output is input", ["{dir}/ok.txt", "{dir}/ok.txt"], "is the input file"),
    ("existing output", ["{dir}/ok.txt", "{dir}/exists.bin"], "exists; choose another path or "
                                                               "pass --force"),
    ("dtype too small", ["{dir}/ok.txt", "{dir}/out", "--tokenizer", "{wide}", "--dtype",
                         "uint16"], "--dtype uint16 holds ids up to 65535 but the tokenizer has "
                                    "70001"),
    ("prefix with .bin", ["{dir}/ok.txt", "{dir}/out.bin", "--format", "indexed"],
     "pass the output without its extension"),
    ("unknown tokenizer", ["{dir}/ok.txt", "{dir}/out", "--tokenizer", "gpt5"],
     "--tokenizer gpt5: not bytes, gpt2, a tokenizer.json"),
    ("glob of nothing", ["{dir}/*.parquet", "{dir}/out"], "matches no file"),
    ("missing input", ["{dir}/absent.txt", "{dir}/out"], "absent.txt does not exist"),
    ("a folder", ["{dir}", "{dir}/out"], "is a folder; pass its files, e.g. "),
]


# Refusals that issue 43 added; each is also checked in-process in the fast tier
# (tests/test_tokenizers.py, tests/test_data_cli.py).
SLOW_DATA_CASES = [
    ("not UTF-8, bytes", ["{dir}/latin1.txt", "{dir}/out"],
     "latin1.txt:3 (byte offset 21): byte b'\\xe9' is not UTF-8; convert the file to UTF-8"),
    ("not UTF-8, blank-lines", ["{dir}/latin1.txt", "{dir}/out", "--documents", "blank-lines"],
     "latin1.txt:3 (byte offset 21): byte b'\\xe9' is not UTF-8"),
    ("an executable", ["{elf}", "{dir}/out", "--format", "indexed"],
     "is not UTF-8 and the file holds NUL bytes: it is binary, not text; pass only text files"),
    ("read-only folder", ["{dir}/ok.txt", "/proc/out.bin"],
     "cannot write /proc/out.bin in the folder /proc ("),
]


@pytest.mark.parametrize("name, args, needle", [
    *(pytest.param(*case, id=case[0]) for case in DATA_CASES),
    *(pytest.param(*case, id=case[0], marks=pytest.mark.slow) for case in SLOW_DATA_CASES)])
def test_bad_hybrid_data_input_is_one_line_and_writes_nothing(name, args, needle, tmp_path):
    paths = _files(tmp_path / "in")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    done = run([DATA, *(a.format(**paths) for a in args)])
    one_line(done, needle)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert (paths["dir"] / "exists.bin").read_bytes() == b"old"


@pytest.mark.parametrize("tokenizer", ["gpt2", "bytes"])
def test_undecodable_bytes_may_be_replaced_and_are_counted(tmp_path, tokenizer):
    paths = _files(tmp_path / "in")
    done = run([DATA, paths["dir"] / "latin1.txt", tmp_path / "out.bin",
                "--tokenizer", tokenizer, "--encoding-errors", "replace"])
    assert done.returncode == 0, done.stderr
    assert "replaced 1 byte that was not UTF-8 with U+FFFD" in done.stdout
    meta = json.loads((tmp_path / "out.bin.meta.json").read_text())
    assert meta["replaced_bytes"] == 1
    if tokenizer == "bytes":  # the byte tokenizer reads the replaced text's UTF-8 bytes
        tokens = (tmp_path / "out.bin").read_bytes()[::2]
        assert tokens == "line one\nline two\ncaf\ufffd\n".encode("utf-8")
