"""Lose a node, go on with fewer (#41): two torchrun "nodes" of 4 workers on 127.0.0.1,
``launcher.min_nodes=1``; node 1's hybrid-train and every process under it SIGKILLed once
the run's metrics show step 5; node 0 regroups alone, re-plans (DP shrunk, the same global
batch in more micro-batches), resumes the newest checkpoint resharded and finishes every step
with the 1-process run's losses."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hybrid.planning.plan_file import load_plan
from test_multinode import TRAIN, free_port, node_command, stop_all
from test_train_cli import _alive, _descendants, _wait_for

STEPS = 8
REJOIN_STEPS = 12
"""The rejoin test's steps; the other tests' ``STEPS`` are its first steps: all of them inside
the learning rate's warm-up (``optim.warmup_steps``, 10), where the schedule does not depend
on ``train.steps``, so one 1-process run of ``REJOIN_STEPS`` is every test's reference."""
BASE = ("model=tiny", "data=synthetic", "train.timeline_step=0", "train.log_every=1000",
        "seed=3", f"train.steps={STEPS}")
SLOW_AFTER_5 = "slow:5:4:3"
"""Node 1's rank 4 takes 3 s more per step from step 5 on (``hybrid.diagnosis.faults``): step 6 is still
running when the test sees step 5 in the metrics and kills node 1."""

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # a loaded machine: generous


def one_process_losses(run_dir: Path, *overrides: str) -> dict[int, float]:
    """The 1-process run's loss per step (layout invariance: every layout trains these)."""
    done = subprocess.run([TRAIN, *BASE, "parallel=single", f"hydra.run.dir={run_dir}",
                           *overrides], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return last_loss_per_step(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The 1-process run's losses over ``REJOIN_STEPS`` (see there)."""
    return one_process_losses(tmp_path_factory.mktemp("reference"),
                              f"train.steps={REJOIN_STEPS}")


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def last_loss_per_step(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir)}


def kill_node(proc: subprocess.Popen) -> set[int]:
    """SIGKILL a node's hybrid-train and every process under it (fork server, workers)."""
    family = _descendants(proc.pid) | {proc.pid}
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return family


def start_two_nodes(tmp_path: Path, endpoint: str, extra: tuple) -> tuple:
    """Node 1 (whose rank is slowed after step 5, so a kill lands inside a step) and node 0,
    each ``hybrid-train`` in ``tmp_path/nodeN``: (node 0, node 1)."""
    node1 = subprocess.Popen(node_command(tmp_path / "node1", 1, endpoint, *extra, base=BASE),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "HYBRID_TEST_FAULT": SLOW_AFTER_5})
    node0 = subprocess.Popen(node_command(tmp_path / "node0", 0, endpoint, *extra, base=BASE),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return node0, node1


@pytest.mark.parametrize("layout, shrunk", [
    (("parallel.dp=2", "parallel.tp=2", "parallel.pp=2"), {"dp": 1, "cp": 1, "tp": 2, "pp": 2}),
    (("parallel.dp=4", "parallel.tp=2", "parallel.pp=1"), {"dp": 2, "cp": 1, "tp": 2, "pp": 1}),
], ids=["dp2xtp2xpp2", "dp4xtp2"])
def test_a_killed_node_leaves_and_node_0_finishes_on_fewer_with_the_same_losses(
        reference, layout, shrunk, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    extra = (*layout, "checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ckpt'}",
             "launcher.min_nodes=1", "train.collective_timeout_s=60")
    node0, node1 = start_two_nodes(tmp_path, endpoint, extra)
    family: set[int] = set()
    try:
        _wait_for(lambda: 5 in last_loss_per_step(tmp_path / "node0"), 300, "step 5")
        family = _descendants(node0.pid) | kill_node(node1)
        killed = time.monotonic()
        first = _wait_for(lambda: [r for r in records(tmp_path / "node0")
                                   if r["layout"] == shrunk], 240, "a step on the new layout")
        to_first_step = time.monotonic() - killed
        print(f"\nkill -> first step on the new layout ({first[0]['step']}): "
              f"{to_first_step:.1f}s")
        out, err = node0.communicate(timeout=240)
        to_end = time.monotonic() - killed
    finally:
        stop_all(node0, node1)
    assert node0.returncode == 0, err[-3000:]
    # #41: node 0 finishes within 2 minutes of the kill plus its own run time (steps 5-8)
    assert to_first_step < 120, to_first_step
    run = records(tmp_path / "node0")
    assert to_end < 120 + sum(r["step_time_s"] for r in run[5:]), to_end
    assert [r["step"] for r in run][:5] == [1, 2, 3, 4, 5]
    assert run[-1]["step"] == STEPS and all(r["layout"] == shrunk for r in run[5:])
    losses = last_loss_per_step(tmp_path / "node0")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert [losses[s] for s in losses] == pytest.approx([reference[s] for s in losses],
                                                        rel=1e-4)
    # One line each: who left and why, the new layout, the checkpoint, the cost.
    assert "warning: node 1 left: its hybrid-train died without a word (killed by a signal" \
        in err, err[-3000:]
    dp, tp, pp = shrunk["dp"], shrunk["tp"], shrunk["pp"]
    assert f"elastic: attempt 1: nodes [0] go on as dp {dp} x tp {tp} x pp {pp} on 1 node x " \
           f"4 ranks" in err
    resumed = [line for line in err.splitlines() if line.startswith("elastic: resuming from")]
    assert len(resumed) == 1 and str(tmp_path / "ckpt" / "step_0000000") in resumed[0]
    assert "elastic: cost: 4 of 8 ranks lost; predicted step time" in err
    assert_no_raw_torch_text(err)
    plan = load_plan(tmp_path / "node0" / "attempt-1")
    assert (plan.layout.dp, plan.layout.tp, plan.layout.pp) == (dp, tp, pp)
    assert plan.cfg.train.global_batch == load_plan(tmp_path / "node0").cfg.train.global_batch
    assert f"over {STEPS} steps (1 re-layout)" in out
    _wait_for(lambda: not any(_alive(pid) for pid in family), 30, "every process to be gone")


RAW_TORCH_TEXT = ("Traceback", "GLHF", "Connection closed by peer", "pair.cc", "gloo/",
                  "RuntimeError", "DistNetworkError")


def assert_no_raw_torch_text(err: str) -> None:
    """The console holds hybrid's lines only: the "attempt ended" line is one short line
    in its own words; torch's and gloo's text goes to train.log at most."""
    for raw in RAW_TORCH_TEXT:
        assert raw not in err, (raw, err[-3000:])
    assert any(" ended: " in line for line in err.splitlines()), err[-3000:]


def stop_node(proc: subprocess.Popen) -> set[int]:
    """SIGSTOP a node's hybrid-train and every process under it: alive, silent."""
    family = _descendants(proc.pid) | {proc.pid}
    for pid in family:
        os.kill(pid, signal.SIGSTOP)
    return family


def test_a_stopped_node_is_counted_gone_at_the_silence_timeout_and_left_behind(reference, tmp_path):
    """SIGSTOP instead of SIGKILL, with the collective timeout at its default (300 s): node 1
    is counted gone once silent for launcher.silence_timeout_s (5 s here), node 0 stops its
    own attempt then and says so in its own words, and goes on alone with the same losses.
    Node 1, continued (SIGCONT) once node 0 runs on the new layout, ends in one line instead
    of rejoining with its stale view."""
    endpoint = f"127.0.0.1:{free_port()}"
    extra = ("checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ckpt'}", "launcher.min_nodes=1",
             "launcher.silence_timeout_s=5")
    node0, node1 = start_two_nodes(tmp_path, endpoint, extra)
    family: set[int] = set()
    try:
        _wait_for(lambda: 5 in last_loss_per_step(tmp_path / "node0"), 300, "step 5")
        stopped = stop_node(node1)
        stopped_at = time.monotonic()
        family = _descendants(node0.pid) | stopped
        _wait_for(lambda: [r for r in records(tmp_path / "node0") if r["layout"]["dp"] == 1],
                  240, "a step on the new layout")
        to_new_layout = time.monotonic() - stopped_at
        print(f"\nSIGSTOP -> first step on the new layout: {to_new_layout:.1f}s")
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        out, err = node0.communicate(timeout=400)
        _, stale_err = node1.communicate(timeout=120)
    finally:
        stop_all(node0, node1)  # SIGKILL ends stopped processes too
    assert node0.returncode == 0, err[-3000:]
    ended = [line for line in err.splitlines() if line.startswith("elastic: attempt 0 ended")]
    assert len(ended) == 1 and ended[0].startswith(
        "elastic: attempt 0 ended: node 1 stopped answering: not heard for "), err
    assert "(launcher.silence_timeout_s=5)" in ended[0], ended[0]
    assert "warning: node 1 left: silence: not heard for" in err, err[-3000:]
    # counted at the silence timeout, not the collective one (300 s): a bound, not a timing
    assert to_new_layout < 150, to_new_layout
    assert_no_raw_torch_text(err)
    losses = last_loss_per_step(tmp_path / "node0")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert [losses[s] for s in losses] == pytest.approx([reference[s] for s in losses],
                                                        rel=1e-4)
    assert records(tmp_path / "node0")[-1]["layout"] == {"dp": 1, "cp": 1, "tp": 2, "pp": 2}
    assert node1.returncode == 1, stale_err[-3000:]
    assert stale_err.strip().splitlines()[-1].startswith(
        "error: node 0 counted this node gone at the end of attempt 0 (silence: not heard "
        "for"), stale_err[-3000:]
    assert "Traceback" not in stale_err
    _wait_for(lambda: not any(_alive(pid) for pid in family), 30, "every process to be gone")


def test_a_node_started_again_is_taken_back_at_the_next_checkpoint(reference, tmp_path):
    """Node 1 killed after step 5, node 0 goes on alone; node 1's hybrid-train started again
    connects, node 0's workers stop at their next checkpoint and both nodes go on as
    dp 2 x tp 2 x pp 2 again; every step's loss is the 1-process run's."""
    steps = REJOIN_STEPS
    endpoint = f"127.0.0.1:{free_port()}"
    extra = ("checkpoint.every=2", f"checkpoint.dir={tmp_path / 'ckpt'}", "launcher.min_nodes=1",
             "train.collective_timeout_s=60", f"train.steps={steps}")

    def start(name: str, rank: int, fault: str) -> subprocess.Popen:
        return subprocess.Popen(node_command(tmp_path / name, rank, endpoint, *extra,
                                             base=BASE),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "HYBRID_TEST_FAULT": fault})

    # rank 0 takes 3 s more per step from step 7 on, in every attempt: node 1, started again
    # as soon as node 0 has re-planned, has until step 10's checkpoint to come back
    node1, node0 = start("node1", 1, SLOW_AFTER_5), start("node0", 0, "slow:7:0:3")
    again = None
    try:
        _wait_for(lambda: 5 in last_loss_per_step(tmp_path / "node0"), 300, "step 5")
        kill_node(node1)
        _wait_for((tmp_path / "node0" / "attempt-1" / "plan.json").exists, 240,
                  "node 0's re-plan")
        again = start("node1-again", 1, "")
        out, err = node0.communicate(timeout=400)
        again_out, again_err = again.communicate(timeout=120)
    finally:
        stop_all(*[p for p in (node0, node1, again) if p is not None])
    assert node0.returncode == 0, err[-3000:]
    assert again.returncode == 0, again_err[-3000:]
    assert "elastic: node 1 is here again: it is taken in at the next checkpoint" in err, err
    run = records(tmp_path / "node0")
    layouts = [(r["step"], r["layout"]["dp"]) for r in run]
    assert run[-1]["step"] == steps and run[-1]["layout"]["dp"] == 2, layouts
    assert any(dp == 1 for _, dp in layouts), layouts
    assert (tmp_path / "node0" / "attempt-2" / "plan.json").exists()
    assert "elastic: attempt 2: nodes [0, 1] go on as dp 2 x tp 2 x pp 2" in err, err
    assert "4 ranks gained (4 -> 8)" in err
    losses = last_loss_per_step(tmp_path / "node0")
    assert sorted(losses) == list(range(1, steps + 1))
    assert [losses[s] for s in losses] == pytest.approx([reference[s] for s in losses],
                                                        rel=1e-4)
