"""Training on Megatron's indexed data through the real commands: a two-way blend of one data
set written by ``hybrid-data`` and one written by megatron-core's ``IndexedDatasetBuilder``.

The 2x2x2 1F1B run equals the 1-process run (rtol 1e-4); a resume on the same layout is
bitwise; the index caches are built once before the ranks start, in the run's folder, never
beside the data.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pydoc_data.topics
import pytest

from hybrid.metrics import read_metrics
from hybrid.testing.accounting import checked_records

BIN = Path(sys.executable).parent
TRAIN, DATA = str(BIN / "hybrid-train"), str(BIN / "hybrid-data")
STEPS = 6
COMMON = ["model=tiny", f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=2",
          "train.log_every=100", "train.timeline_step=0", "seed=5", "data=indexed",
          "data.split=[90,8,2]", "eval.every=3", "eval.batches=2"]

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def megatron_builder_files(prefix: Path) -> Path:
    """Documents of bytes (ids < 256) of CPython's own library sources, written by
    megatron-core's builder with no hybrid metadata, as Megatron's preprocessing would."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    sources = sorted(Path(os.__file__).parent.glob("*.py"))[:120]
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for path in sources:
        ids = np.frombuffer(path.read_bytes()[:3000], dtype=np.uint8).astype(np.int64)
        builder.add_item(torch.from_numpy(ids))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("data")
    text = folder / "topics.txt"
    text.write_text("\n\n".join(pydoc_data.topics.topics.values()), encoding="utf-8")
    done = subprocess.run([DATA, text, folder / "topics", "--format", "indexed",
                           "--documents", "blank-lines", "--quiet"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    library = megatron_builder_files(folder / "library")
    return {"folder": folder, "files": sorted(p.name for p in folder.iterdir()),
            "blend": f"data.blend=[0.7,{folder / 'topics'},0.3,{library}]"}


def run_train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    done = subprocess.run([TRAIN, *COMMON, f"hydra.run.dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def evals(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in read_metrics(run_dir / "metrics.jsonl")
            if "eval_loss" in r}


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in checked_records(run_dir)]


def test_2x2x2_equals_one_process_and_resumes_bitwise(blend, tmp_path):
    one = run_train(tmp_path / "one", blend["blend"], "parallel=single")
    assert "data: built megatron-core's sample indices in" in one.stderr
    reference = losses(tmp_path / "one")
    assert len(reference) == STEPS and reference[-1] < reference[0]

    run_train(tmp_path / "full", blend["blend"], "checkpoint.every=3")  # base: 2x2x2 1F1B
    full = losses(tmp_path / "full")
    assert full[0] == pytest.approx(reference[0], rel=1e-5)
    assert full == pytest.approx(reference, rel=1e-4)

    # the validation split, evaluated on both layouts and after the resume
    one_eval, full_eval = evals(tmp_path / "one"), evals(tmp_path / "full")
    assert sorted(one_eval) == [3, 6] and full_eval == pytest.approx(one_eval, rel=1e-5)

    resumed = tmp_path / "resumed"
    run_train(resumed, blend["blend"],
              f"checkpoint.resume_from={tmp_path / 'full' / 'checkpoints' / 'step_00000003'}")
    assert [r["loss"] for r in read_metrics(resumed / "metrics.jsonl")] == full[3:]
    assert evals(resumed) == {6: full_eval[6]}  # the cadence counts from the run's start
    # the run's checkpoint carries the byte-level tokenizer of the data: generation decodes
    done = subprocess.run([str(BIN / "hybrid-generate"), str(tmp_path / "full"), "prompt=The ",
                           "max_new_tokens=8", "temperature=0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("The "), done.stderr[-2000:]
    # every run built its caches in its own folder, and nothing was written beside the data;
    # the train and validation parts only (3 files each per data set, 2 per blend): nothing
    # reads the test part
    assert sorted(p.name for p in blend["folder"].iterdir()) == blend["files"]
    for run in ("one", "full", "resumed"):
        assert len(list((tmp_path / run / "data_cache").glob("*.npy"))) == 16
        assert not list((tmp_path / run / "data_cache").glob("*-test-*"))


def test_a_shared_cache_is_built_once_and_reused(blend, tmp_path):
    cache = tmp_path / "cache"
    first = run_train(tmp_path / "first", blend["blend"], "parallel=single", "train.steps=2",
                      f"data.cache_dir={cache}")
    assert f"built megatron-core's sample indices in {cache}" in first.stderr
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    second = run_train(tmp_path / "second", blend["blend"], "parallel=single", "train.steps=2",
                       f"data.cache_dir={cache}")
    assert "built megatron" not in second.stderr
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps
    assert not (tmp_path / "second" / "data_cache").exists()
    assert losses(tmp_path / "second") == losses(tmp_path / "first")
