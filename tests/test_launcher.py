"""``run_local``: results by rank, failures that name the rank, and no process left behind.

The worker functions live in this module (workers import it by name), so it imports nothing
heavy at the top.
Workers record their pid in a file so the tests can prove every one of them is gone.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hybrid.testing import PRELOAD
from launch.launchers.local import WorkerFailure, default_omp_threads, run_local, worker_env_summary

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# As hybrid-train starts its workers, from this pytest process's one fork server (shared with
# ``hybrid.testing.spawn``): each test pays fork cost, not two imports of torch.
FORKED = {"start_method": "forkserver", "preload": PRELOAD}
LONG_JOB_S = 600  # far beyond every test timeout: a worker only ends early if it is stopped


# ---- worker side ---------------------------------------------------------------------------

def _record_pid(pid_dir):
    # Written under a temporary name, then renamed: a reader never sees half a pid.
    rank = os.environ["RANK"]
    tmp = os.path.join(pid_dir, f".{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(pid_dir, f"{rank}.pid"))


def _wait_for_pid_files(pid_dir, count, timeout=60.0, launcher=None):
    """Poll (bounded) until ``count`` workers wrote their pid; fail early if ``launcher`` ends."""
    deadline = time.monotonic() + timeout
    while len([n for n in os.listdir(pid_dir) if n.endswith(".pid")]) < count:
        if launcher is not None and launcher.poll() is not None:
            raise RuntimeError(f"launcher exited ({launcher.returncode}) before its workers "
                               f"started:\n{launcher.stdout.read()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only some of {count} workers started within {timeout}s")
        time.sleep(0.02)
    return {int(n.split(".")[0]): int(open(os.path.join(pid_dir, n)).read())
            for n in os.listdir(pid_dir) if n.endswith(".pid")}


def sum_of_ranks():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return int(os.environ["RANK"]), int(total), os.environ["OMP_NUM_THREADS"], \
        worker_env_summary()


def fail_on_rank_one(pid_dir):
    _record_pid(pid_dir)
    _wait_for_pid_files(pid_dir, int(os.environ["WORLD_SIZE"]))
    if os.environ["RANK"] == "1":
        raise ValueError("rank one cannot go on: bad shard")
    time.sleep(LONG_JOB_S)


def sigkill_rank_zero(pid_dir):
    _record_pid(pid_dir)
    _wait_for_pid_files(pid_dir, int(os.environ["WORLD_SIZE"]))
    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(LONG_JOB_S)


def sigint_rank_zero(pid_dir):
    _record_pid(pid_dir)
    _wait_for_pid_files(pid_dir, int(os.environ["WORLD_SIZE"]))
    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGINT)
    time.sleep(LONG_JOB_S)


def long_job(pid_dir):
    _record_pid(pid_dir)
    time.sleep(LONG_JOB_S)


# ---- test side -----------------------------------------------------------------------------

def _assert_all_gone(pids, timeout=15.0):
    """Every pid has exited and been reaped (a zombie still answers kill(pid, 0))."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive.discard(pid)
        if alive:
            time.sleep(0.05)
    assert not alive, f"worker processes still exist: {sorted(alive)}"


@pytest.mark.timeout(120)  # < 20 s on 2 idle cores; slack for shared ones
def test_two_workers_return_values_by_rank(tmp_path):
    env_before = {key: os.environ.get(key)
                  for key in ("OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE")}
    results = run_local(sum_of_ranks, (), nproc=2, omp_threads=3, run_dir=tmp_path, **FORKED)
    assert [r[:3] for r in results] == [(0, 3, "3"), (1, 3, "3")]
    assert results[1][3].startswith("RANK=1 LOCAL_RANK=1 WORLD_SIZE=2")
    # The launcher's own process is as it was: environment and Ctrl-C handler.
    assert {key: os.environ.get(key) for key in env_before} == env_before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert default_omp_threads(2) >= 1


@pytest.mark.timeout(120)  # < 20 s on 2 idle cores; slack for shared ones
def test_raising_worker_names_its_rank_and_leaves_no_processes(tmp_path):
    with pytest.raises(WorkerFailure) as info:
        run_local(fail_on_rank_one, (str(tmp_path),), nproc=2, run_dir=tmp_path / "run", **FORKED)
    err = info.value
    assert err.rank == 1 and err.summary == \
        "rank 1 failed: ValueError: rank one cannot go on: bad shard"
    assert str(err).startswith(err.summary + "\n")
    assert "in fail_on_rank_one" in err.traceback
    assert "torch/distributed/elastic" not in err.traceback  # the agent's wrapper is cut
    _assert_all_gone(_wait_for_pid_files(str(tmp_path), 2).values())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.timeout(120)  # < 20 s on 2 idle cores; slack for shared ones
def test_worker_killed_by_signal_is_a_failure_and_leaves_no_processes(tmp_path):
    with pytest.raises(WorkerFailure) as info:
        run_local(sigkill_rank_zero, (str(tmp_path),), nproc=2, run_dir=tmp_path / "run", **FORKED)
    err = info.value
    assert err.rank == 0 and err.exitcode == -signal.SIGKILL
    assert err.summary.startswith("rank 0 failed: killed by signal SIGKILL")
    _assert_all_gone(_wait_for_pid_files(str(tmp_path), 2).values())


@pytest.mark.timeout(120)  # < 20 s on 2 idle cores; slack for shared ones
def test_sigint_to_one_worker_is_a_failure_not_a_hang(tmp_path):
    # torch treats a worker's KeyboardInterrupt as a clean exit without a result; the agent
    # would then wait for that result forever.
    with pytest.raises(WorkerFailure) as info:
        run_local(sigint_rank_zero, (str(tmp_path),), nproc=2, run_dir=tmp_path / "run", **FORKED)
    assert info.value.summary == "rank 0 failed: WorkerInterrupted: got SIGINT and stopped"
    _assert_all_gone(_wait_for_pid_files(str(tmp_path), 2).values())


LAUNCHER_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests_dir!r})
    from launch.launchers.local import run_local
    import test_launcher

    if __name__ == "__main__":
        run_local(test_launcher.long_job, ({pid_dir!r},), nproc=2, run_dir={run_dir!r})
""")


@pytest.mark.slow
@pytest.mark.timeout(120)  # < 20 s on 2 idle cores; slack for shared ones
@pytest.mark.parametrize("target", ["launcher", "process-group"])
def test_ctrl_c_stops_all_workers(tmp_path, target):
    """SIGINT to the launcher alone, or to its whole process group as a terminal's Ctrl-C."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = LAUNCHER_SCRIPT.format(tests_dir=TESTS_DIR, pid_dir=str(pid_dir),
                                    run_dir=str(tmp_path / "run"))
    launcher = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        worker_pids = _wait_for_pid_files(str(pid_dir), 2, launcher=launcher)
        if target == "launcher":
            os.kill(launcher.pid, signal.SIGINT)
        else:
            os.killpg(launcher.pid, signal.SIGINT)
        output, _ = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode != 0
    assert "KeyboardInterrupt: all 2 workers were stopped" in output
    _assert_all_gone(worker_pids.values())
