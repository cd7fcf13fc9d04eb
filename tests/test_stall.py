"""A stalled rank ends the job with a diagnosis (issue 14); the slow-rank warning is checked in
test_train_e2e.py's run-directory run.

Each test runs the real ``hybrid-train`` and checks the command's last error line, the run
directory's ``failure.json`` and that no process of the job is left.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid.planning.layout import Layout
from test_train_cli import _alive, _descendants, _parent_of, _wait_for

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
TINY = ["model=tiny", "data=synthetic", "train.timeline_step=0", "train.log_every=1000"]
WHO = r"rank (\d) \(dp (\d), tp (\d), pp (\d), node 0\)"

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]


def start(run_dir: Path, *overrides: str, fault: str = "") -> subprocess.Popen:
    env = dict(os.environ, HYBRID_TEST_FAULT=fault) if fault else None
    return subprocess.Popen([TRAIN, *TINY, f"hydra.run.dir={run_dir}", *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for the command; return its stderr (killing it and its family past ``timeout``)."""
    try:
        return proc.communicate(timeout=timeout)[1]
    finally:
        if proc.poll() is None:
            for pid in _descendants(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()


def first_step_done(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and bool(path.read_text())


def check_diagnosis(stderr: str, run_dir: Path, *, stalled: int, layout: Layout) -> re.Match:
    """The last line names who waited (with coordinates and node), on what, at which step,
    and, down the chain of waits, the stalled rank as the one that never reported;
    failure.json agrees."""
    last = stderr.strip().splitlines()[-1]
    match = re.match(rf"error: {WHO} waited [\d.]+s at step (\d+) in (.+?); never arrived: ",
                     last)
    assert match, stderr[-3000:]
    waiter = int(match[1])
    w = layout.coords(waiter)
    assert match.group(2, 3, 4) == (str(w["dp"]), str(w["tp"]), str(w["pp"]))
    c = layout.coords(stalled)
    assert re.search(rf"rank {stalled} \(dp {c['dp']}, tp {c['tp']}, pp {c['pp']}, node 0\)"
                     rf"(,| never arrived,) no report: stopped", last), last
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["silent_ranks"] == [stalled] and failure["diagnosis"] in last
    waiting = failure["ranks"][str(waiter)]
    assert waiting["reported"] and waiting["step"] == int(match[5]) and waiting["waiting"]
    return match


@pytest.mark.parametrize("axis, stalled, waited_on", [
    ("tp", 1, r"TP all_reduce #1 over ranks \[0, 1\]"),
    ("dp", 1, r"DP all_reduce #1 over ranks \[0, 1\]"),
    ("pp", 0, r"pipeline 1RECV_F0 \(micro-batch 0 of stage 1\) from rank 0"),
])
def test_a_rank_stalled_in_a_collective_or_receive_is_named(tmp_path, axis, stalled,
                                                             waited_on):
    """The test hook stops ``stalled`` (SIGSTOP) just before its first operation on ``axis``
    at step 2; its peer fails after the timeout naming it, and no process is left."""
    proc = start(tmp_path, "parallel=single", f"parallel.{axis}=2", "train.steps=50", "train.collective_timeout_s=4",
                 fault=f"stall_{axis}:2:{stalled}")
    _wait_for(lambda: first_step_done(tmp_path), 90, "the first step")
    family = _descendants(proc.pid)
    stderr = finish(proc, 90)
    assert proc.returncode == 1, stderr[-3000:]
    layout = Layout(**{axis: 2})
    match = check_diagnosis(stderr, tmp_path, stalled=stalled, layout=layout)
    assert int(match[5]) == 2 and re.fullmatch(waited_on, match[6]), match[0]
    _wait_for(lambda: not any(_alive(pid) for pid in family), 15, "every process to be gone")


def test_sigstop_of_one_of_8_workers_ends_the_job_within_60s(tmp_path):
    """The issue's case: the main job's layout, one worker stopped from outside mid-run."""
    proc = start(tmp_path, "train.steps=1000", "train.collective_timeout_s=12")
    _wait_for(lambda: first_step_done(tmp_path), 90, "the first step")
    family = _descendants(proc.pid)
    workers = sorted(pid for pid in family if _parent_of(pid) != proc.pid)
    assert len(workers) == 8, workers
    # Ranks above 0 write into workers/<run>/attempt_0/<rank>/stdout.log (rank 0: console).
    rank = 5
    victim = next(pid for pid in workers if f"attempt_0/{rank}/" in os.readlink(f"/proc/{pid}/fd/1"))
    stopped_at = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    stderr = finish(proc, 60)
    assert time.monotonic() - stopped_at < 60
    assert proc.returncode == 1, stderr[-3000:]
    check_diagnosis(stderr, tmp_path, stalled=rank, layout=Layout(dp=2, tp=2, pp=2))
    _wait_for(lambda: not any(_alive(pid) for pid in family), 15, "every process to be gone")


STOP_S, RUN_S = 0.05, 0.005
"""The throttle's duty cycle: the victim runs at most 1/11 of the time. The warning needs the
victim slow (1.5x its peers' median, 10% of the step) in 9 of 12 steps, and a worker throttled
to about twice its peers' compute was slow in 9 of 12 at most (``hybrid.diagnosis.stragglers``):
the old 40/20 ms cycle sat at that edge, and under load its own sleeps overrun, the run window
most (a longer run window is a faster victim). At 50/5 ms a run window stretched 5x still
leaves the victim under a third of its speed, and its compute phases (a few ms per pipeline
action) rarely fit in one window unhit: slow in every step by construction."""


@pytest.mark.timeout(600)  # start-up and 28 throttled steps on a machine shared by many jobs
def test_a_worker_throttled_from_outside_is_named_as_the_straggler(tmp_path):
    """#31's case: one of 8 workers stopped and continued from outside, again and again
    (SIGSTOP 50 ms, SIGCONT 5 ms: ``STOP_S``, ``RUN_S``), on the main job's layout with its
    tiny steps: the warning names its global rank with its coordinates, and no other rank."""
    from hybrid.testing.throttle import Throttle, worker_pid

    proc = start(tmp_path, "train.steps=28", "train.collective_timeout_s=120")  # 2 windows + 4
    try:
        _wait_for(lambda: first_step_done(tmp_path), 240, "the first step")
        rank = 6
        victim = worker_pid(proc.pid, rank)
        assert victim is not None
        with Throttle(victim, stop_s=STOP_S, run_s=RUN_S):
            stderr = finish(proc, 300)
    finally:
        if proc.poll() is None:  # the wait for the first step failed: leave nothing behind
            for pid in _descendants(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    named = re.findall(rf"warning: straggler: {WHO} computes", stderr)
    c = Layout(dp=2, tp=2, pp=2).coords(rank)
    assert named and set(named) == {(str(rank), str(c["dp"]), str(c["tp"]), str(c["pp"]))}, \
        stderr[-3000:]
