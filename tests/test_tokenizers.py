"""``hybrid-data``'s tokenizers: GPT-2 offline with tiktoken's ids, HF tokenizer files, a BPE
trained on the user's text, and parallel workers that change nothing but the speed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pydoc_data.topics
import pytest

import hybrid.data.tokenizer as tokenizer_module
from hybrid.data.metadata import read_meta
from hybrid.data.tokenizer import TokenizerError, gpt2_files, load_tokenizer

HYBRID_DATA = str(Path(sys.executable).parent / "hybrid-data")
TOPICS = pydoc_data.topics.topics  # CPython's own documentation: real English on any machine
PAGE = "\n\n".join(TOPICS[name] for name in sorted(TOPICS)[:12])

pytestmark = pytest.mark.timeout(180)


def run(*args, **kwargs):
    return subprocess.run([HYBRID_DATA, *map(str, args)], capture_output=True, text=True,
                          timeout=150, **kwargs)


def tiktoken_gpt2():
    """tiktoken's GPT-2 encoding built offline from the same two files, hash-checked by
    tiktoken itself (``TIKTOKEN_CACHE_DIR=""``: it copies nothing anywhere)."""
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    files, hashes = gpt2_files(), tiktoken_expected_hashes()
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(files["vocab.bpe"]), encoder_json_file=str(files["encoder.json"]),
        vocab_bpe_hash=hashes["vocab.bpe"], encoder_json_hash=hashes["encoder.json"])
    return tiktoken.Encoding("gpt2-offline", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256})


def tiktoken_expected_hashes() -> dict:
    """The hashes tiktoken's ``gpt2()`` checks its downloads against, read from its source
    (calling it would download)."""
    import inspect
    import re

    from tiktoken_ext.openai_public import gpt2

    source = inspect.getsource(gpt2)
    return {"vocab.bpe": re.search(r'vocab_bpe_hash="([0-9a-f]{64})"', source)[1],
            "encoder.json": re.search(r'encoder_json_hash="([0-9a-f]{64})"', source)[1]}


def test_hybrid_checks_gpt2s_files_against_tiktokens_hashes():
    assert tokenizer_module.GPT2_FILES == tiktoken_expected_hashes()


def tokens_of(path: Path, dtype="uint16") -> list[int]:
    return np.fromfile(path, dtype=dtype).tolist()


def test_gpt2_gives_gpt2s_ids_equal_to_tiktoken_on_a_page_of_real_text(tmp_path):
    hello = tmp_path / "hello.txt"
    hello.write_text("Hello world")
    assert run(hello, tmp_path / "hello.bin", "--tokenizer", "gpt2").returncode == 0
    assert tokens_of(tmp_path / "hello.bin") == [15496, 995, 50256]

    page = tmp_path / "page.txt"  # with a special token's spelling inside the text
    page.write_text(PAGE + "\nA literal <|endoftext|> stays text.\n", encoding="utf-8")
    done = run(page, tmp_path / "page.bin", "--tokenizer", "gpt2")
    assert done.returncode == 0, done.stderr
    reference = tiktoken_gpt2().encode_ordinary(page.read_text(encoding="utf-8")) + [50256]
    assert len(reference) > 10_000
    assert tokens_of(tmp_path / "page.bin") == reference
    meta = read_meta(str(tmp_path / "page.bin"))
    assert meta["tokenizer"]["kind"] == "gpt2" and meta["tokenizer"]["vocab_size"] == 50257
    assert (tmp_path / "page.bin.tokenizer.json").is_file()


def test_gpt2_files_with_the_wrong_hash_are_refused(monkeypatch):
    monkeypatch.setitem(tokenizer_module.GPT2_FILES, "vocab.bpe", "0" * 64)
    with pytest.raises(TokenizerError, match=r"vocab.bpe has SHA-256 1ce16647.*not GPT-2's 0000"):
        load_tokenizer("gpt2")


def test_a_trained_bpe_is_used_from_its_folder_or_from_vocab_and_merges(tmp_path):
    corpus = tmp_path / "topics.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TOPICS.values()))
    done = run("train-tokenizer", corpus, tmp_path / "bpe", "--vocab-size", "1000")
    assert done.returncode == 0, done.stderr
    assert "(<|endoftext|> = 0)" in done.stdout
    trained = load_tokenizer(str(tmp_path / "bpe"))
    assert (trained.info.vocab_size, trained.info.eod) == (1000, 0)
    text = TOPICS["assert"]
    lengths, ids = trained.encode([text])
    assert trained.decode(ids[:-1]) == text and ids[-1] == 0

    files = tmp_path / "vocab-merges"  # the same BPE as GPT-2-style vocab.json + merges.txt
    files.mkdir()
    trained.tokenizer.model.save(str(files))
    assert load_tokenizer(str(files)).encode([text])[1].tolist() == ids.tolist()

    done = run(corpus, tmp_path / "topics", "--tokenizer", tmp_path / "bpe", "--format",
               "indexed")
    assert done.returncode == 0, done.stderr
    assert "vocab 1000" in done.stdout and "model.vocab=1000" in done.stdout
    meta = read_meta(str(tmp_path / "topics"))
    assert meta["documents"] == len(TOPICS) and meta["dtype"] == "uint16"


def test_end_of_document_token_is_found_or_asked_for(tmp_path):
    from tokenizers import Tokenizer, models

    plain = tmp_path / "plain.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(plain))
    with pytest.raises(TokenizerError, match=r"has no end-of-document token .*pass --eod TOKEN"):
        load_tokenizer(str(plain))
    assert load_tokenizer(str(plain), eod_token="[UNK]").info.eod == 2
    with pytest.raises(TokenizerError, match=r"--eod <end>: the tokenizer .* has no such token"):
        load_tokenizer(str(plain), eod_token="<end>")
    folder = tmp_path / "with-config"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(plain.read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "b"}}))
    assert load_tokenizer(str(folder)).info.eod == 1


@pytest.mark.slow
def test_workers_change_nothing_but_the_speed(tmp_path):
    corpus = tmp_path / "topics.jsonl"  # ~2.4 MB: three chunks
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TOPICS.values()) * 5)
    one = run(corpus, tmp_path / "one", "--tokenizer", "gpt2", "--format", "indexed")
    two = run(corpus, tmp_path / "two", "--tokenizer", "gpt2", "--format", "indexed",
              "--workers", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    for suffix in (".bin", ".idx", ".tokenizer.json"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes()
    assert read_meta(str(tmp_path / "two"))["documents"] == 5 * len(TOPICS)


@pytest.mark.parametrize("documents", ["file", "blank-lines"])
def test_the_byte_tokenizer_refuses_what_is_not_utf8(tmp_path, documents):
    """docs/data.md: text that is not UTF-8 is refused, whatever the tokenizer; an executable
    is named as binary."""
    from hybrid.data.documents import InputError, ReadOptions
    from hybrid.data.prepare import Request, prepare_data

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("plain line\n\ncaf\u00e9 au lait\n".encode("latin-1"))
    program = tmp_path / "program"
    program.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(8) + bytes(range(256)) * 4)
    for path, needle in ((latin1, "latin1.txt:3 (byte offset 15): byte b'\\xe9' is not UTF-8; "
                                  "convert the file to UTF-8, or pass --encoding-errors replace"),
                         (program, "is not UTF-8 and the file holds NUL bytes: it is binary")):
        with pytest.raises(InputError) as refused:
            prepare_data(Request(inputs=[str(path)], output=str(tmp_path / "out"),
                                 read=ReadOptions(documents=documents), progress=False))
        assert needle in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latin1.txt", "program"]
