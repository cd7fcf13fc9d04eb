"""Megatron's indexed format both ways: megatron-core reads what ``hybrid-data --format indexed``
writes, hybrid reads what megatron-core's ``IndexedDatasetBuilder`` writes, byte for byte."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from hybrid.data.indexed import read_index, write_index
from hybrid.data.metadata import read_meta

HYBRID_DATA = str(Path(sys.executable).parent / "hybrid-data")
DOCUMENTS = ["The first document.", "A second, longer document: " + "words " * 40,
             "Ünïcödé and emoji 🙂 in the third.", "4"]

pytestmark = pytest.mark.timeout(120)


def megatron_indexed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def test_megatron_reads_the_documents_and_tokens_hybrid_data_wrote(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    done = subprocess.run([HYBRID_DATA, source, tmp_path / "corpus", "--format", "indexed",
                           "--tokenizer", "gpt2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "use: data=indexed data.path=" in done.stdout

    from hybrid.data.tokenizer import load_tokenizer

    expected = [list(ids) for ids in _split(*load_tokenizer("gpt2").encode(DOCUMENTS))]
    dataset = megatron_indexed().IndexedDataset(str(tmp_path / "corpus"))
    assert len(dataset) == len(DOCUMENTS)
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert all(doc[-1] == 50256 for doc in expected)  # every document ends with GPT-2's EOD
    assert dataset.index.dtype == np.uint16  # megatron's own choice for 50257 ids
    assert dataset.document_indices.tolist() == list(range(len(DOCUMENTS) + 1))
    meta = read_meta(str(tmp_path / "corpus"))
    assert meta["documents"] == len(DOCUMENTS) and meta["tokenizer"]["eod"] == 50256
    assert meta["tokens"] == sum(map(len, expected))


def test_hybrid_reads_megatron_builder_output_and_writes_the_same_bytes(tmp_path):
    import torch

    indexed = megatron_indexed()
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 50257, size=n) for n in (5, 1, 17, 300)]
    for dtype in (np.uint16, np.int32):
        prefix = str(tmp_path / f"megatron-{np.dtype(dtype).name}")
        builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for doc in documents:
            builder.add_item(torch.from_numpy(doc))
            builder.end_document()
        builder.finalize(prefix + ".idx")
        info = read_index(prefix)
        assert (info.documents, info.tokens, info.dtype) == (4, 323, np.dtype(dtype))

        ours = tmp_path / f"ours-{np.dtype(dtype).name}.idx"
        with open(ours, "wb") as handle:
            write_index(handle, dtype, np.array([len(d) for d in documents]))
        assert ours.read_bytes() == Path(prefix + ".idx").read_bytes()
        flat = np.concatenate(documents).astype(dtype)
        assert flat.tobytes() == Path(prefix + ".bin").read_bytes()


def _split(lengths, flat):
    return np.split(flat, np.cumsum(lengths)[:-1])


@pytest.mark.slow
def test_a_blend_keeps_its_weights_within_1_percent_over_10000_samples(tmp_path):
    """hybrid-plan out=DIR settles a run of 1,250 steps of 8 (its caches built there); the
    run's first 10,000 samples come from each data set by its weight, as the ranks read them."""
    from hybrid.data import open_dataset
    from hybrid.data.prepare import Request, prepare_data
    from hybrid.data.documents import ReadOptions
    from hybrid.planning.plan_file import load_plan

    prefixes = []
    for name, words in (("a", "alpha beta gamma"), ("b", "delta epsilon")):
        text = tmp_path / f"{name}.txt"
        text.write_text("\n\n".join(f"{words} {i} " * (i % 7 + 1) for i in range(400)))
        prepare_data(Request(inputs=[str(text)], output=str(tmp_path / name), format="indexed",
                             read=ReadOptions(documents="blank-lines"), progress=False))
        prefixes.append(tmp_path / name)
    plan_cli = str(Path(sys.executable).parent / "hybrid-plan")
    done = subprocess.run([plan_cli, "model=tiny", "parallel=single", "train.global_batch=8",
                           "train.steps=1250", "data=indexed", "data.split=[98,2,0]",
                           "eval.batches=2",  # the validation splits hold 2 batches of 8
                           f"data.blend=[0.7,{prefixes[0]},0.3,{prefixes[1]}]",
                           f"out={tmp_path / 'run'}"], capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr
    plan = load_plan(tmp_path / "run")
    assert plan.data_prefixes == tuple(map(str, prefixes))
    assert plan.data_cache_dir == str(tmp_path / "run" / "data_cache")
    samples = open_dataset(plan)
    assert samples.ordered and len(samples) >= 10_000
    sources = np.array([samples.source_of(i) for i in range(10_000)])
    assert abs((sources == 0).mean() - 0.7) < 0.01 and abs((sources == 1).mean() - 0.3) < 0.01
    first = samples[0]
    assert first.shape == (33,) and first.dtype == np.int64 and first.max() < 256


def _damage(prefix: Path, field: str, entry: int, value: int) -> None:
    """Overwrite entry ``entry`` of the index's ``field`` (pointers or documents)."""
    from hybrid.data.indexed import HEADER

    sequences = read_index(str(prefix)).documents
    at = {"pointers": HEADER.size + 4 * sequences,
          "documents": HEADER.size + 12 * sequences}[field] + 8 * entry
    with open(f"{prefix}.idx", "r+b") as handle:
        handle.seek(at)
        handle.write(np.int64(value).tobytes())


@pytest.mark.parametrize("field, entry, value, needle", [
    ("pointers", 3, 10**9, "sequence 3 points to byte 1000000000 of"),
    ("pointers", 1, 0, "sequence 1 points to byte 0 of"),
    ("pointers", 2, 2, "sequence 2 points to byte 2 of"),
    ("documents", 2, 9, "its document boundaries do not rise from 0 to its 4 sequences"),
])
def test_an_index_pointing_outside_its_data_is_refused(tmp_path, monkeypatch, field, entry,
                                                        value, needle):
    """The lengths still add up to the .bin's size; only a pointer (or a boundary) is wrong,
    which megatron would follow unchecked when that document is read."""
    import hybrid.data.indexed
    from hybrid.data.dataset import DataError

    monkeypatch.setattr(hybrid.data.indexed, "SCAN_ENTRIES", 2)  # the scan's steps too
    done = subprocess.run([HYBRID_DATA, write_jsonl(tmp_path / "in.jsonl", DOCUMENTS),
                           tmp_path / "data", "--format", "indexed", "--quiet"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert read_index(str(tmp_path / "data")).documents == 4
    _damage(tmp_path / "data", field, entry, value)
    with pytest.raises(DataError, match="data.idx: ") as refused:
        read_index(str(tmp_path / "data"))
    assert needle in str(refused.value) and "\n" not in str(refused.value)
