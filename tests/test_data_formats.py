"""``hybrid-data`` on data as it is shipped: Parquet and gzip/zstd-compressed JSON Lines give the
tokens of the same documents given as plain JSONL, and a damaged file is one line."""

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import hybrid.data.readers
from hybrid.data.documents import ReadOptions
from hybrid.data.prepare import Request, prepare_data

DATA = str(Path(sys.executable).parent / "hybrid-data")
KEY = "content"
WORDS = ["the", "data", "Grüße", "naïve", "東京", "emoji 🙂", 'a "quote"', "back\\slash",
         "tab\there", "line\nbreak", "<|endoftext|>"]

pytestmark = pytest.mark.timeout(120)


def documents(count: int = 400) -> list[str]:
    """Generated documents: unicode, escapes, newlines inside, and some empty ones."""
    rng = random.Random(7)
    return ["" if i % 37 == 5 else " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
            for i in range(count)]


def write_inputs(folder: Path, docs: list[str]) -> dict[str, Path]:
    """The same documents as plain JSONL, gzip and zstd JSONL, and Parquet."""
    lines = "".join(json.dumps({"id": i, KEY: doc}) + "\n" for i, doc in enumerate(docs))
    data = lines.encode("utf-8")
    paths = {name: folder / name for name in
             ("docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet")}
    paths["docs.jsonl"].write_bytes(data)
    paths["docs.jsonl.gz"].write_bytes(gzip.compress(data))
    half = data.index(b"\n", len(data) // 2) + 1  # two frames, as parallel zstd writes them
    compressor = zstandard.ZstdCompressor(write_checksum=True)
    paths["docs.jsonl.zst"].write_bytes(compressor.compress(data[:half]) +
                                        compressor.compress(data[half:]))
    table = pa.table({"id": list(range(len(docs))), KEY: docs})
    pq.write_table(table, paths["docs.parquet"], row_group_size=150)  # several row groups
    return paths


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    return write_inputs(tmp_path_factory.mktemp("inputs"), documents())


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([DATA, *map(str, args)], capture_output=True, text=True, timeout=100)


def outputs(prefix: Path, fmt: str) -> dict[str, bytes]:
    suffixes = (".bin", ".idx") if fmt == "indexed" else ("",)
    return {suffix: Path(f"{prefix}{suffix}").read_bytes() for suffix in suffixes}


@pytest.mark.parametrize("fmt, tokenizer", [("tokens", "bytes"), ("indexed", "gpt2")])
def test_every_container_gives_the_tokens_of_plain_jsonl(inputs, tmp_path, monkeypatch, fmt,
                                                         tokenizer):
    monkeypatch.setattr(hybrid.data.readers, "CHUNK_BYTES", 2048)  # many chunks of each
    # a gzip file whose name does not say so is read by its magic bytes
    disguised = tmp_path / "gzipped.jsonl"
    disguised.write_bytes(inputs["docs.jsonl.gz"].read_bytes())
    results = {}
    for name, path in [*inputs.items(), ("disguised", disguised)]:
        prefix = tmp_path / name.replace(".", "_")
        report = prepare_data(Request(inputs=[str(path)], output=str(prefix), format=fmt,
                                      tokenizer=tokenizer, read=ReadOptions(json_key=KEY),
                                      progress=False))
        assert report.documents == sum(1 for doc in documents() if doc)
        assert report.empty == sum(1 for doc in documents() if not doc)
        results[name] = outputs(prefix, fmt)
    for name, result in results.items():
        assert result == results["docs.jsonl"], name


@pytest.mark.slow
def test_parallel_workers_read_every_container_through_the_command(inputs, tmp_path):
    containers = [inputs[name] for name in ("docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet")]
    copies = [tmp_path / f"copy{i}.jsonl" for i in range(3)]  # the same file thrice is read once
    for copy in copies:
        copy.write_bytes(inputs["docs.jsonl"].read_bytes())
    plain = run(*copies, tmp_path / "plain", "--format", "indexed", "--json-key", KEY, "--quiet")
    shipped = run(*containers, tmp_path / "shipped", "--format", "indexed", "--json-key", KEY,
                  "--workers", "2", "--quiet")
    assert plain.returncode == 0 and shipped.returncode == 0, plain.stderr + shipped.stderr
    assert outputs(tmp_path / "shipped", "indexed") == outputs(tmp_path / "plain", "indexed")
    meta = json.loads((tmp_path / "shipped.meta.json").read_text())
    assert meta["inputs"] == [str(path) for path in containers]


def _damaged(folder: Path, inputs: dict[str, Path]) -> dict[str, Path]:
    """Files each broken in one way, named by it."""
    def cut(name: str, keep: float) -> bytes:
        data = inputs[name].read_bytes()
        return data[:int(len(data) * keep)]

    gz = bytearray(inputs["docs.jsonl.gz"].read_bytes())
    gz[len(gz) // 2] ^= 0xFF
    other = [json.dumps({"body": "x"}) + "\n"]
    files = {
        "cut.jsonl.gz": cut("docs.jsonl.gz", 0.5), "cut.jsonl.zst": cut("docs.jsonl.zst", 0.7),
        "flipped.jsonl.gz": bytes(gz), "cut.parquet": cut("docs.parquet", 0.6),
        "text.parquet": b"PAR0 is not Parquet\n", "plain.jsonl.gz": b'{"text": "plain"}\n',
        "key.jsonl.gz": gzip.compress("".join(other).encode()),
        "key.jsonl.zst": zstandard.ZstdCompressor().compress("".join(other).encode()),
        "docs.parquet.gz": gzip.compress(inputs["docs.parquet"].read_bytes()),
        "surrogate.jsonl.gz": gzip.compress(b'{"content": "fine"}\n{"content": "a \\ud800"}\n'),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    pq.write_table(pa.table({"body": ["x"], "n": [1]}), folder / "key.parquet")
    pq.write_table(pa.table({KEY: [1, 2]}), folder / "numbers.parquet")
    pq.write_table(pa.table({KEY: ["a", None, "c"]}), folder / "null.parquet")
    return {path.name: path for path in folder.iterdir()}


CASES = [
    ("cut.jsonl.gz", "cut.jsonl.gz: its gzip stream is damaged or cut short after line "),
    ("cut.jsonl.zst", "cut.jsonl.zst: its zstd stream is damaged or cut short after line "),
    ("flipped.jsonl.gz", "flipped.jsonl.gz: its gzip stream is damaged or cut short"),
    ("cut.parquet", "cut.parquet: a damaged Parquet file ("),
    ("text.parquet", "text.parquet is not a Parquet file (its first bytes are b'PAR0', not "
                     "b'PAR1')"),
    ("plain.jsonl.gz", "plain.jsonl.gz is named .gz but is not gzip"),
    ("key.jsonl.gz", "key.jsonl.gz:1: no key 'content' (found: body); pass --json-key KEY"),
    ("key.jsonl.zst", "key.jsonl.zst:1: no key 'content' (found: body); pass --json-key KEY"),
    ("key.parquet", "key.parquet: no column 'content' (found: body, n); pass --json-key COLUMN"),
    ("numbers.parquet", "numbers.parquet: column 'content' holds int64, not text"),
    ("null.parquet", "null.parquet: row index 1 has no 'content' (null)"),
    ("docs.parquet.gz", "docs.parquet.gz is a gzip-compressed Parquet file; Parquet compresses "
                        "its own pages: decompress it with gzip first"),
    ("surrogate.jsonl.gz", "surrogate.jsonl.gz:2: 'content' holds the lone surrogate '\\ud800', "
                           "which is not text; fix the line, or pass --encoding-errors replace"),
]


def test_a_damaged_or_mislabelled_file_is_refused_naming_it(inputs, tmp_path):
    from hybrid.data.documents import InputError

    files = _damaged(tmp_path, inputs)
    for name, needle in CASES:
        with pytest.raises(InputError) as refused:
            prepare_data(Request(inputs=[str(files[name])], output=str(tmp_path / "out"),
                                 read=ReadOptions(json_key=KEY), progress=False))
        assert needle in str(refused.value) and "\n" not in str(refused.value), name
    assert not list(tmp_path.glob("*out*"))


@pytest.mark.slow
@pytest.mark.parametrize("name, needle", CASES, ids=[case[0] for case in CASES])
def test_a_damaged_or_mislabelled_file_is_one_line_and_writes_nothing(inputs, tmp_path, name,
                                                                        needle):
    (tmp_path / "in").mkdir()
    files = _damaged(tmp_path / "in", inputs)
    done = run(inputs["docs.jsonl"], files[name], tmp_path / "out", "--format", "indexed",
               "--json-key", KEY, "--workers", "2")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_progress_counts_the_file_bytes_not_the_decompressed_ones(inputs):
    from hybrid.data.readers import read_chunks

    for name in ("docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet"):
        chunks = list(read_chunks([inputs[name]], ReadOptions(json_key=KEY)))
        assert sum(chunk.progress for chunk in chunks) == inputs[name].stat().st_size, name


def test_parquet_rows_keep_their_bytes(tmp_path):
    from hybrid.data.documents import chunk_documents
    from hybrid.data.readers import read_chunks

    docs = ["a", "", "Grüße", "x" * 5000]
    pq.write_table(pa.table({"text": docs}), tmp_path / "t.parquet", row_group_size=3)
    for as_bytes in (False, True):
        options = ReadOptions(as_bytes=as_bytes)
        found = [chunk_documents(c, options) for c in read_chunks([tmp_path / "t.parquet"],
                                                                  options)]
        texts = [t for f in found for t in f.texts]
        expected = [d for d in docs if d]
        assert texts == ([d.encode() for d in expected] if as_bytes else expected)
        assert sum(f.empty for f in found) == 1


@pytest.mark.parametrize("mode", ["file", "blank-lines"])
def test_compressed_text_reads_as_the_text(tmp_path, mode):
    from hybrid.data.documents import chunk_documents
    from hybrid.data.readers import read_chunks

    text = "\n\n".join(doc for doc in documents(60) if doc.strip()).encode("utf-8")
    (tmp_path / "a.txt").write_bytes(text)
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text))
    (tmp_path / "a.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text))
    options = ReadOptions(documents=mode)
    read = {name: [t for c in read_chunks([tmp_path / name], options)
                   for t in chunk_documents(c, options).texts]
            for name in ("a.txt", "a.txt.gz", "a.txt.zst")}
    assert read["a.txt.gz"] == read["a.txt.zst"] == read["a.txt"]
    assert len(read["a.txt"]) == (1 if mode == "file" else text.count(b"\n\n") + 1)


def test_a_zstd_frame_with_a_long_window_is_read(tmp_path):
    """``zstd --long=30`` writes frames that zstandard's default decoder refuses (128 MiB)."""
    from hybrid.data.documents import chunk_documents
    from hybrid.data.readers import read_chunks

    data = "".join(json.dumps({"text": doc}) + "\n" for doc in documents(50) if doc).encode()
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=30)
    with open(tmp_path / "long.jsonl.zst", "wb") as handle:
        with zstandard.ZstdCompressor(compression_params=params).stream_writer(handle) as out:
            out.write(data)  # streamed: the frame keeps its 1 GiB window
    assert zstandard.get_frame_parameters((tmp_path / "long.jsonl.zst").read_bytes()
                                          ).window_size == 1 << 30
    options = ReadOptions()
    texts = [t for c in read_chunks([tmp_path / "long.jsonl.zst"], options)
             for t in chunk_documents(c, options).texts]
    assert texts == [doc for doc in documents(50) if doc]


def test_a_lone_surrogate_may_be_replaced_and_is_counted():
    from hybrid.data.documents import Chunk, chunk_documents

    chunk = Chunk("x.jsonl", 1, "jsonl", b'{"text": "a \\ud800 b"}\n')
    for as_bytes in (False, True):
        found = chunk_documents(chunk, ReadOptions(encoding_errors="replace", as_bytes=as_bytes))
        assert found.texts == (["a \ufffd b".encode()] if as_bytes else ["a \ufffd b"])
        assert found.replaced == 1
