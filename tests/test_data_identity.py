"""A checkpoint's data is compared by what it is, not where it lies (#43, pure)."""

from types import SimpleNamespace

from hybrid.data.fingerprint import changed_file, changed_tokenizer, order_changes

BYTES = {"kind": "bytes", "source": "bytes", "vocab_size": 256, "eod": None, "sha256": "b"}


def record(path: str, size: int = 10, digest: str = "x") -> dict:
    return {"file": path, "bytes": size, "edges_sha256": digest}


def test_the_same_bytes_at_another_path_are_the_same_data():
    assert changed_file([record("/a/x.bin"), record("/a/x.idx")],
                        [record("/b/x.bin"), record("/b/x.idx")]) is None


def test_other_bytes_name_both_paths_and_what_differs():
    assert changed_file([record("/a/x.bin")], [record("/b/x.bin", digest="y")]) == \
        "/b/x.bin (the checkpoint's /a/x.bin) has the same size but other contents than then"
    assert changed_file([record("/a/x.bin")], [record("/a/x.bin", size=5)]) == \
        "/a/x.bin had 10 bytes then and has 5 now"
    assert changed_file([], [record("/a/x.bin")]) == \
        "it trained on generated data, this run reads /a/x.bin"


def test_a_tokenizer_read_from_elsewhere_is_the_same_one():
    saved = {"tokenizer": BYTES}
    assert changed_tokenizer(saved, {**BYTES, "source": "/elsewhere/tokenizer.json"}) is None
    assert changed_tokenizer({}, None) is None  # saved before checkpoints recorded it
    assert changed_tokenizer(saved, {**BYTES, "kind": "hf", "vocab_size": 300, "sha256": "h"}) \
        == "it was tokenized with bytes (vocabulary 256), this run's data with hf (vocabulary 300)"


def test_a_new_split_or_blend_is_warned_of_like_a_new_seed():
    cfg = SimpleNamespace(seed=1, train=SimpleNamespace(global_batch=8),
                          data=SimpleNamespace(source="indexed", split=[90, 10, 0],
                                               blend=[3, "A", 1, "B"]))
    saved = {"seed": 1, "global_batch": 8, "split": [969.0, 30.0, 1.0],
             "blend_weights": [0.5, 0.5]}
    assert order_changes(saved, cfg) == [
        "data.split=[90,10,0] (the checkpoint's [969,30,1])",
        "data.blend's weights=[0.75,0.25] (the checkpoint's [0.5,0.5])"]
