"""``parallel.pp_balance=dynamic`` through ``hybrid-train`` (issue 55), on pp2 with 8 layers:
two runs, each checking several things:

- the static run is the reference (the split of ``parallel.partition``, all run);
- a dynamic run whose stage 1 is slowed (``hybrid.diagnosis.faults``' slow: it sleeps in
  every step's compute, so the split moves within the first decisions, whatever the machine's
  load) gives stage 1 fewer layers, the state moved through a checkpoint at the step
  boundary, and its losses equal the static run's (rtol 1e-5): the math does not change;
- it checkpoints at step 6, after the move: the checkpoint's manifest holds the split that
  step 7 runs on (what a resume continues on, ``tests/test_pp_balance.py``).

Step times are not asserted here (the machine is shared): ``bench/pp_balance.py`` measures
them, with a stage's worker throttled from outside (SIGSTOP/SIGCONT cycles). The decision
logic (a slowdown starts and stops; an undisturbed noisy run) is in
``tests/test_pp_balance.py``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.checkpoint.store import read_manifest
from hybrid.planning.stage_balance import layer_counts
from hybrid.testing.accounting import checked_records

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
COMMON = ["model=tiny", "model.layers=8", "model.seq_len=16", "data=synthetic",
          "parallel=single", "parallel.pp=2", "train.micro_batch=2", "train.global_batch=8",
          "train.timeline_step=0", "train.log_every=1000", "train.collective_timeout_s=120",
          "parallel.pp_balance_every=2", "train.steps=8"]
SLOW = "slow:1:1:0.2"
"""Global rank 1 (pipeline stage 1 on pp2) sleeps 0.2 s in every step from step 1."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def train(run_dir: Path, *overrides: str, slow: bool = False):
    env = dict(os.environ, OMP_NUM_THREADS="1", **({"HYBRID_TEST_FAULT": SLOW} if slow else {}))
    done = subprocess.run([TRAIN, *COMMON, f"hydra.run.dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return checked_records(run_dir), done.stderr


def test_a_slow_stage_gives_up_layers_and_the_losses_stay(tmp_path):
    static, _ = train(tmp_path / "static")
    assert all("pp_split" not in r for r in static)
    slowed, said = train(tmp_path / "slowed", "parallel.pp_balance=dynamic",
                         "checkpoint.every=6", slow=True)
    splits = [r["pp_split"] for r in slowed]
    assert splits[0] == [4, 4] and splits[-1][1] < 4 and sum(splits[-1]) == 8, splits
    moved = [line for line in said.splitlines() if line.startswith("pp_balance: ")]
    assert moved and "layers per stage [4, 4] -> " in moved[0], said[-2000:]
    assert [r["loss"] for r in slowed] == pytest.approx([r["loss"] for r in static], rel=1e-5)
    assert not (tmp_path / "slowed" / "checkpoints" / "pp_balance").exists()

    # the step-6 checkpoint holds the split step 7 runs on: what a resume continues on
    # (``hybrid.balance.stages.resumed_plan``, tests/test_pp_balance.py)
    manifest = read_manifest(tmp_path / "slowed" / "checkpoints" / "step_00000006")
    assert layer_counts([range(*blocks) for blocks in manifest["stages"]]) == splits[6]
