"""``parallel.dp_balance=dynamic`` through ``hybrid-train`` (issue 40), on dp2, dp2 x pp2 under
1F1B (with ZeRO-1), dp4 under ZeRO-2 and dp2 under ZeRO-3 (``after_step``); two runs a
layout, each checking several things:

- an undisturbed run under dynamic keeps even shares all run; so it computes what even shares
  do (bitwise: same shares, same order) and is the layout's even reference;
- a run whose DP replica 1 is slowed (``hybrid.diagnosis.faults``' slow: it sleeps in every step's
  compute, so its shares move within the first decisions, whatever the machine's load) gives
  that replica fewer micro-batches, and its losses equal the reference's (rtol 1e-5);
- on dp2 that run checkpoints at step 6, and a resume from it continues its shares and losses.

Step times are not asserted here (the machine is shared): ``bench/dp_balance.py`` measures
them, with a replica throttled from outside (SIGSTOP/SIGCONT cycles), and its smallest run is
in ``tests/test_bench_smoke.py``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.testing.accounting import checked_records

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
COMMON = ["model=tiny", "data=synthetic", "parallel=single", "train.micro_batch=2",
          "train.timeline_step=0", "train.log_every=1000", "train.collective_timeout_s=120",
          "model.seq_len=16", "parallel.dp_balance=dynamic", "parallel.dp_balance_every=3"]
LAYOUTS = {  # name: (overrides, micro-batches per replica under even shares)
    "dp2": (["parallel.dp=2", "train.global_batch=16"], 4),
    "dp2xpp2-1f1b-zero1": (["parallel.dp=2", "parallel.pp=2", "parallel.schedule=1f1b",
                            "parallel.zero=1", "train.global_batch=16"], 4),
    "dp4-zero2": (["parallel.dp=4", "parallel.zero=2", "train.global_batch=16"], 2),
    # the weights gathered once a step; gradients reduce-scattered per micro-batch, as ZeRO-2
    "dp2-zero3": (["parallel.dp=2", "parallel.zero=3", "parallel.zero3_reshard=after_step",
                   "train.global_batch=16"], 4),
}
STEPS = 9
SLOW = "slow:1:1:0.3"
"""Global rank 1 (rank order tp-cp-dp-pp: DP replica 1, pipeline stage 0) sleeps 0.3 s in
every step from step 1."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def train(run_dir: Path, *overrides: str, slow: bool = False):
    env = dict(os.environ, HYBRID_TEST_FAULT=SLOW) if slow else None
    done = subprocess.run([TRAIN, *COMMON, f"hydra.run.dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return checked_records(run_dir)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_slow_replica_gets_fewer_microbatches_and_the_losses_stay(layout, tmp_path):
    overrides, even = LAYOUTS[layout]
    steps = [f"train.steps={STEPS}", *overrides]
    reference = train(tmp_path / "undisturbed", *steps)
    dp = len(reference[0]["dp_shares"])
    assert [r["dp_shares"] for r in reference] == [[even] * dp] * STEPS
    saving = ["checkpoint.every=6"] if layout == "dp2" else []
    slowed = train(tmp_path / "slowed", *steps, *saving, slow=True)
    shares = [r["dp_shares"] for r in slowed]
    assert shares[0] == [even] * dp and all(sum(s) == even * dp for s in shares)
    assert shares[-1][1] < even, shares  # the slow replica runs fewer
    assert [r["loss"] for r in slowed] == pytest.approx([r["loss"] for r in reference],
                                                        rel=1e-5)
    if saving:
        check_resume(tmp_path, steps, slowed)


def check_resume(tmp_path: Path, steps: list[str], first: list[dict]) -> None:
    """The resumed run (not slowed) starts from the checkpoint's shares: bitwise its losses."""
    assert first[6]["dp_shares"] != first[0]["dp_shares"], [r["dp_shares"] for r in first]
    saved = tmp_path / "slowed" / "checkpoints" / "step_00000006"
    resumed = train(tmp_path / "resumed", *steps, f"checkpoint.resume_from={saved}")
    assert [r["step"] for r in resumed] == list(range(7, STEPS + 1))
    assert resumed[0]["dp_shares"] == first[6]["dp_shares"]
    assert resumed[0]["loss"] == first[6]["loss"]  # same shares, same order: bitwise
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in first[6:]],
                                                         rel=1e-6)
