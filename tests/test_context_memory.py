"""Context parallelism's point: at a long sequence (4096 tokens) the activations each rank keeps
for backward fall as 1/cp, and the memory model predicts them (within 5%), through
``hybrid-train``'s own ``memory_check.json`` (saved-tensor hooks at the step's peak)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
COMMON = ["model=tiny", "data=synthetic", "data.samples=8", "model.seq_len=4096",
          "train.steps=1", "train.global_batch=1", "train.micro_batch=1",
          "train.log_every=100", "train.timeline_step=0", "parallel=single"]

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def activation_bytes(run_dir: Path, cp: int) -> tuple[list[int], list[int]]:
    done = subprocess.run([TRAIN, *COMMON, f"parallel.cp={cp}", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads((run_dir / "memory_check.json").read_text())["ranks"]
    return ([r["activation_peak_bytes"] for r in ranks],
            [r["predicted_activation_bytes"] for r in ranks])


def test_activations_per_rank_fall_as_1_over_cp_as_predicted(tmp_path):
    (one,), (predicted_one,) = activation_bytes(tmp_path / "cp1", 1)
    assert one == pytest.approx(predicted_one, rel=0.05)
    for cp in (2, 4):
        counted, predicted = activation_bytes(tmp_path / f"cp{cp}", cp)
        assert len(counted) == cp
        for mine, model in zip(counted, predicted):
            assert mine == pytest.approx(one / cp, rel=0.05), (cp, mine, one)
            assert mine == pytest.approx(model, rel=0.05), (cp, mine, model)
