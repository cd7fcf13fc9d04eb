"""Evaluation reads what the validation data holds, once (#43 item 7): ``eval.batches`` is
checked against an indexed validation split's samples (counted from its ``.idx`` as
megatron-core counts them, blends included), data=synthetic's held-out walks and an absolute
limit, before any worker starts; and a run evaluates whenever its data has a validation split
unless told otherwise (``eval.every``/``eval.at_end`` left unset)."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hybrid.data.eval_split import most_batches, validation_samples
from hybrid.data.indexed import write_index
from hybrid.planning.config import DataConfig, EvalConfig
from hybrid.planning.data_sources import (EVAL_SAMPLES_LIMIT, eval_cadence, eval_problem,
                                          eval_size_problem)

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
SPLIT = [80, 20, 0]


def write_pair(prefix: Path, documents: int, seed: int) -> str:
    """An indexed pair of ``documents`` byte-level documents of 20-80 tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 80, documents)
    rng.integers(0, 256, int(lengths.sum()), dtype=np.uint16).tofile(f"{prefix}.bin")
    with open(f"{prefix}.idx", "wb") as handle:
        write_index(handle, np.uint16, lengths)
    return str(prefix)


INDEXED = DataConfig(source="indexed", path="p")
CADENCES = [
    (EvalConfig(), INDEXED, (20, True)),  # a validation split: on, as Megatron-LM does
    (EvalConfig(), DataConfig(source="indexed", path="p", split=[1, 0, 0]), (0, False)),
    (EvalConfig(), DataConfig(), (0, False)),  # synthetic: held-out walks only when asked
    (EvalConfig(), DataConfig(source="tokens", path="t"), (0, False)),
    (EvalConfig(every=0), INDEXED, (0, False)),  # 0 is never
    (EvalConfig(every=5), INDEXED, (5, True)),
    (EvalConfig(every=5), DataConfig(), (5, False)),
    (EvalConfig(every=5, at_end=False), INDEXED, (5, False)),
    (EvalConfig(at_end=True), DataConfig(), (0, True)),
]


@pytest.mark.parametrize("eval_cfg, data, expected", CADENCES)
def test_unset_eval_settings_evaluate_where_there_is_a_validation_split(eval_cfg, data,
                                                                        expected):
    assert eval_cadence(eval_cfg, data) == expected
    assert eval_problem(eval_cfg, data) is None  # only settings given can ask for data


def test_an_evaluation_larger_than_the_limit_or_the_held_out_walks_is_refused():
    assert eval_size_problem(EvalConfig(every=5, batches=100_000_000), DataConfig(),
                             16) is not None
    line = eval_size_problem(EvalConfig(batches=100_000_000), INDEXED, 16)
    assert line == (f"eval.batches=100000000 x train.global_batch=16 = 1,600,000,000 samples "
                    f"per evaluation is beyond the limit of {EVAL_SAMPLES_LIMIT:,}; choose "
                    f"eval.batches <= {EVAL_SAMPLES_LIMIT // 16}")
    assert eval_size_problem(EvalConfig(batches=100_000_000), DataConfig(), 16) is None  # off
    assert eval_size_problem(EvalConfig(every=5, batches=300), DataConfig(samples=4096), 16) \
        == ("eval.batches=300 x train.global_batch=16 = 4,800 samples per evaluation, and "
            "data=synthetic holds out data.samples=4,096 walks (as many as it trains on); "
            "choose eval.batches <= 256")
    assert eval_size_problem(EvalConfig(every=5, batches=256), DataConfig(samples=4096),
                             16) is None


def _epochs(datasets, split: int) -> list[int]:
    """How many passes megatron built over each data set's ``split`` part."""
    dataset = datasets[split]
    parts = getattr(dataset, "datasets", [dataset])
    return [len(np.load(part.path_to_document_index)) // len(part.indices) for part in parts]


@pytest.mark.slow
@pytest.mark.parametrize("weights", [None, (0.7, 0.3)], ids=["one", "blend"])
def test_the_most_batches_counted_from_the_index_are_one_pass_of_megatrons(tmp_path,
                                                                            weights):
    """megatron-core builds the validation split of ``most`` batches in one pass over each
    data set's part, and of ``most + 1`` in more: the count is its own."""
    from hybrid.data.megatron import IndexedSpec, _build, build_caches

    prefixes = tuple(write_pair(tmp_path / name, 300, seed)
                     for name, seed in (("a", 1), ("b", 2))[:1 if weights is None else 2])
    held = [validation_samples(p, SPLIT, 32) for p in prefixes]
    most = most_batches(held, weights, 8)
    assert most > 2
    for batches, passes in ((most, 1), (most + 1, 2)):
        spec = IndexedSpec(prefixes=prefixes, weights=weights, split=(0.8, 0.2, 0.0),
                           seq_len=32, seed=3, sizes=(8, batches * 8, 8),
                           cache_dir=str(tmp_path / f"cache{batches}"), vocab_size=256)
        build_caches(spec)
        assert max(_epochs(_build(spec, spec.cache_dir, defer=True), 1)) == passes


def _refused(tmp_path, *overrides: str) -> str:
    run_dir = tmp_path / "run"
    done = subprocess.run([TRAIN, "model=tiny", "parallel=single", f"hydra.run.dir={run_dir}",
                           *overrides], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert not run_dir.exists()  # nothing written: no data cache, no run files
    return lines[0].removeprefix("error: ")


@pytest.mark.slow
def test_hybrid_train_refuses_more_batches_than_the_validation_split_holds(tmp_path):
    """2,000 batches re-read a small validation split ~70 times; refused in one line naming
    the most that fit, before megatron builds an index."""
    prefix = write_pair(tmp_path / "corpus", 300, 1)
    most = most_batches([validation_samples(prefix, SPLIT, 32)], None, 16)
    line = _refused(tmp_path, "data=indexed", f"data.path={prefix}", "data.split=[80,20,0]",
                    "eval.batches=2000")
    assert line.startswith("eval.batches=2000 x train.global_batch=16 = 32,000 samples per "
                           f"evaluation, and the validation split of {prefix} holds ")
    assert line.endswith("samples of model.seq_len+1=33 tokens: it would read them more than "
                         f"once; choose eval.batches <= {most}")


@pytest.mark.slow
def test_hybrid_train_refuses_a_huge_eval_batches_at_once(tmp_path):
    """1e8 batches sat 6.5 minutes silent before any worker (megatron's index build)."""
    started = time.monotonic()
    line = _refused(tmp_path, "eval.batches=100000000")
    assert line.startswith("eval.batches=100000000 x train.global_batch=16 = 1,600,000,000 ")
    assert time.monotonic() - started < 30  # no data is built: one composition and a check


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_indexed_with_a_validation_split_reports_its_validation_loss_unasked(tmp_path):
    """docs/data.md's case: data=indexed with a validation part and no eval.* setting."""
    import json

    prefix = write_pair(tmp_path / "corpus", 300, 1)
    run_dir = tmp_path / "run"
    done = subprocess.run([TRAIN, "model=tiny", "parallel=single", "train.steps=3",
                           "train.global_batch=8", "train.timeline_step=0", "data=indexed",
                           f"data.path={prefix}", "data.split=[80,20,0]",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [3]  # at the end
    assert records[-1]["eval_tokens"] == 4 * 8 * 32
