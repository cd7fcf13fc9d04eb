"""Data sets and the DP-sharded loader: layout-independent batches, epochs, every error."""

import math
import pickle

import numpy as np
import pytest
import torch

from hybrid.planning.config import DataConfig, ModelConfig, TrainConfig
from hybrid.data import (DataError, MarkovDataset, TokenFileDataset, epoch_permutation,
                         global_batch_indices, make_dataset, markov_entropy, max_token,
                         rank_microbatches, steps_per_epoch, validate_data)

SEED = 1234


def _write_tokens(path, values, dtype="uint16"):
    np.asarray(values, dtype=dtype).tofile(path)
    return str(path)


def _all_ranks_step(dataset, step, *, global_batch, micro_batch, dp):
    """Concatenate every DP rank's micro-batches of ``step``, in DP-rank order."""
    tokens, labels = [], []
    for dp_rank in range(dp):
        for mb_tokens, mb_labels in rank_microbatches(
                dataset, step, global_batch=global_batch, micro_batch=micro_batch, dp=dp,
                dp_rank=dp_rank, seed=SEED):
            tokens.append(mb_tokens)
            labels.append(mb_labels)
    return torch.cat(tokens), torch.cat(labels)


# ---- the synthetic Markov chain ------------------------------------------------------------

def test_markov_samples_are_a_pure_function_of_seed_and_index():
    a = MarkovDataset(vocab=256, seq_len=32, samples=100, seed=7)
    b = MarkovDataset(vocab=256, seq_len=32, samples=100, seed=7)
    other_seed = MarkovDataset(vocab=256, seq_len=32, samples=100, seed=8)
    assert a[42].shape == (33,) and a[42].dtype == np.int64
    # Reading sample 42 first or after others gives the same tokens: no hidden stream state.
    first = a[42].copy()
    _ = [a[i] for i in range(10)]
    np.testing.assert_array_equal(first, a[42])
    np.testing.assert_array_equal(first, b[42])
    assert not np.array_equal(a[42], other_seed[42])
    assert not np.array_equal(a[42], a[43])


def test_markov_chain_follows_its_sparse_successors_and_has_the_stated_entropy():
    ds = MarkovDataset(vocab=256, seq_len=64, samples=400, seed=SEED)
    samples = np.stack([ds[i] for i in range(len(ds))])
    assert samples.min() >= 0 and samples.max() < 256
    current, following = samples[:, :-1].ravel(), samples[:, 1:].ravel()
    assert all(len(set(row)) == len(row) for row in ds.successors.tolist())
    assert np.all((ds.successors[current] == following[:, None]).any(axis=1))
    # Empirical conditional entropy is close to the floor, far below ln(vocab).
    pair_counts = np.zeros((256, 256))
    np.add.at(pair_counts, (current, following), 1)
    row_totals = pair_counts.sum(axis=1, keepdims=True)
    nonzero = pair_counts > 0
    probs = pair_counts[nonzero] / np.broadcast_to(row_totals, pair_counts.shape)[nonzero]
    entropy = -(pair_counts[nonzero] * np.log(probs)).sum() / pair_counts.sum()
    assert abs(entropy - markov_entropy()) < 0.05
    assert markov_entropy() < math.log(256) / 3


def test_markov_tiny_vocab_still_works():
    ds = MarkovDataset(vocab=2, seq_len=8, samples=4, seed=0)
    assert set(np.unique(ds[0])) <= {0, 1}


# ---- token files ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows_have_stride_seq_len(tmp_path, dtype):
    seq_len, values = 4, np.arange(23) + (70000 if dtype == "uint32" else 0)
    path = _write_tokens(tmp_path / "t.bin", values, dtype)
    ds = make_dataset(DataConfig(source="tokens", path=path, dtype=dtype),
                      ModelConfig(vocab=100000, seq_len=seq_len), SEED)
    assert len(ds) == (23 - 1) // seq_len == 5
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds[i], values[i * seq_len:i * seq_len + seq_len + 1])
    # Every adjacent pair (x[t], x[t+1]) of the used prefix is a target exactly once.
    pairs = [(int(s[j]), int(s[j + 1])) for s in (ds[i] for i in range(len(ds)))
             for j in range(seq_len)]
    assert sorted(pairs) == [(int(values[t]), int(values[t + 1])) for t in range(5 * seq_len)]
    with pytest.raises(IndexError):
        ds[5]


def test_token_file_dataset_pickles_by_path(tmp_path):
    path = _write_tokens(tmp_path / "t.bin", np.arange(50))
    ds = TokenFileDataset(path=path, dtype="uint16", vocab=256, seq_len=8)
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 1000
    np.testing.assert_array_equal(clone[3], ds[3])


def test_max_token_scans_in_chunks():
    values = np.arange(1000, dtype=np.uint16)
    assert max_token(values, chunk=7) == 999


# ---- the loader ----------------------------------------------------------------------------

@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_ranks_together_give_the_one_process_global_batch(dp):
    ds = make_dataset(DataConfig(samples=64), ModelConfig(seq_len=16), SEED)
    for step in (0, 1, 5, 9):
        reference = _all_ranks_step(ds, step, global_batch=16, micro_batch=2, dp=1)
        sharded = _all_ranks_step(ds, step, global_batch=16, micro_batch=2, dp=dp)
        assert torch.equal(reference[0], sharded[0]) and torch.equal(reference[1], sharded[1])
        expected = np.stack([ds[int(i)] for i in global_batch_indices(
            step, num_samples=len(ds), global_batch=16, seed=SEED)])
        assert torch.equal(reference[0], torch.from_numpy(expected[:, :-1]))
        assert torch.equal(reference[1], torch.from_numpy(expected[:, 1:]))


def test_micro_batch_shapes_dtypes_and_labels_shifted_by_one():
    ds = make_dataset(DataConfig(samples=64), ModelConfig(seq_len=16), SEED)
    micro = rank_microbatches(ds, 0, global_batch=16, micro_batch=2, dp=2, dp_rank=1, seed=SEED)
    assert len(micro) == 4
    for tokens, labels in micro:
        assert tokens.shape == labels.shape == (2, 16)
        assert tokens.dtype == labels.dtype == torch.int64
        assert torch.equal(tokens[:, 1:], labels[:, :-1])


def test_every_sample_once_per_epoch_and_epochs_differ():
    num_samples, global_batch = 50, 8  # 6 steps per epoch; 2 samples dropped each epoch
    per_epoch = steps_per_epoch(num_samples, global_batch)
    assert per_epoch == 6
    epochs = []
    for epoch in range(3):
        seen = np.concatenate([
            global_batch_indices(step, num_samples=num_samples, global_batch=global_batch,
                                 seed=SEED)
            for step in range(epoch * per_epoch, (epoch + 1) * per_epoch)])
        assert len(seen) == len(set(seen.tolist())) == per_epoch * global_batch
        epochs.append(seen)
        np.testing.assert_array_equal(
            np.sort(epoch_permutation(num_samples, SEED, epoch)), np.arange(num_samples))
    assert not np.array_equal(epochs[0], epochs[1])


def test_loader_is_deterministic_and_seeded():
    ds = make_dataset(DataConfig(samples=64), ModelConfig(seq_len=16), SEED)
    kwargs = dict(global_batch=16, micro_batch=4, dp=2, dp_rank=0)
    first = rank_microbatches(ds, 3, seed=SEED, **kwargs)
    again = rank_microbatches(make_dataset(DataConfig(samples=64), ModelConfig(seq_len=16),
                                           SEED), 3, seed=SEED, **kwargs)
    other = rank_microbatches(ds, 3, seed=SEED + 1, **kwargs)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other))


def test_loader_rejects_indivisible_batches_and_bad_ranks():
    ds = make_dataset(DataConfig(samples=64), ModelConfig(seq_len=16), SEED)
    with pytest.raises(DataError, match="train.global_batch=10 is not divisible"):
        rank_microbatches(ds, 0, global_batch=10, micro_batch=2, dp=2, dp_rank=0, seed=SEED)
    with pytest.raises(ValueError, match="dp_rank=2"):
        rank_microbatches(ds, 0, global_batch=8, micro_batch=2, dp=2, dp_rank=2, seed=SEED)
    with pytest.raises(ValueError, match="step=-1"):
        rank_microbatches(ds, -1, global_batch=8, micro_batch=2, dp=2, dp_rank=0, seed=SEED)


# ---- validation errors ---------------------------------------------------------------------

def _validate(tmp_path, values=None, raw=None, dtype="uint16", vocab=256, seq_len=8,
              global_batch=4, **data):
    path = tmp_path / "t.bin"
    if values is not None:
        _write_tokens(path, values, dtype)
    if raw is not None:
        path.write_bytes(raw)
    data = {"source": "tokens", "path": str(path), "dtype": dtype, **data}
    return validate_data(DataConfig(**data), ModelConfig(vocab=vocab, seq_len=seq_len),
                         TrainConfig(global_batch=global_batch, micro_batch=1))


def test_validate_accepts_a_good_file_and_counts_samples(tmp_path):
    assert _validate(tmp_path, values=np.arange(41) % 256) == 5
    assert validate_data(DataConfig(), ModelConfig(), TrainConfig()) == DataConfig().samples


@pytest.mark.parametrize("case, match", [
    ({"source": "web"}, r"data.source='web' is unknown; choose one of synthetic, tokens"),
    ({"dtype": "int8", "values": [1, 2]}, r"data.dtype='int8' is unknown; choose uint16"),
    ({"path": None}, r"data.source=tokens needs data.path; make a token file with `hybrid-data"),
    ({}, r"data.path=.*t.bin does not exist; fix the path or make the file"),
    ({"raw": b"\x01\x02\x03"}, r"has 3 bytes, not a multiple of 2 \(data.dtype=uint16\); "
                               r"set data.dtype"),
    ({"dtype": "uint32", "raw": bytes(6)},
     r"has 6 bytes, not a multiple of 4 \(data.dtype=uint32\)"),
    ({"values": np.arange(8)}, r"holds 8 tokens, fewer than model.seq_len\+1=9 for one sample"),
    ({"values": np.arange(33)}, r"holds 4 samples of model.seq_len\+1=9 tokens \(stride 8\), "
                                r"fewer than train.global_batch=5; use a longer file"),
    ({"values": np.r_[np.arange(40), 300]},
     r"holds token id 300 >= model.vocab=256; set model.vocab=301 or more, or retokenize"),
])
def test_validate_errors_name_the_field_and_the_fix(tmp_path, case, match):
    with pytest.raises(DataError, match=match) as info:
        _validate(tmp_path, global_batch=5 if "stride" in match else 4, **case)
    assert "\n" not in str(info.value)


def test_synthetic_errors():
    with pytest.raises(DataError, match=r"data.samples=8 is fewer than train.global_batch=16; "
                                         r"raise data.samples"):
        validate_data(DataConfig(samples=8), ModelConfig(), TrainConfig(global_batch=16))
    with pytest.raises(DataError, match=r"data.samples=0 must be >= 1"):
        make_dataset(DataConfig(samples=0), ModelConfig(), SEED)
    with pytest.raises(DataError, match=r"model.vocab=1 is too small"):
        make_dataset(DataConfig(), ModelConfig(vocab=1), SEED)


def test_bad_token_caught_when_read_even_without_validation(tmp_path):
    path = _write_tokens(tmp_path / "t.bin", np.r_[np.arange(20), 999])
    ds = make_dataset(DataConfig(source="tokens", path=path), ModelConfig(seq_len=4), SEED)
    assert ds[0].max() == 4
    with pytest.raises(DataError, match="token id 999 >= model.vocab=256"):
        ds[4]


def test_an_ordered_source_is_read_in_order_and_never_past_its_size():
    """megatron's data sets are shuffled and sized for the run: step t reads samples t*B...,
    the same on every layout and after a resume."""
    indices = global_batch_indices(3, num_samples=40, global_batch=8, seed=1, ordered=True)
    assert indices.tolist() == list(range(24, 32))
    with pytest.raises(DataError, match="step 6 needs samples up to 48 but the data set was "
                                        "built with 40"):
        global_batch_indices(5, num_samples=40, global_batch=8, seed=1, ordered=True)
