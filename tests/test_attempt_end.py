"""The "attempt ended" line in hybrid's words (``launch/launchers/attempt_end.py``) and node 0's
guard that ends an attempt once a node falls silent (``launch/launchers/silence.py``), in one
process; the real command's runs are in test_elastic.py."""

import threading
import time

import pytest

from launch.launchers.attempt_end import attempt_end_reason, in_own_words, keep_raw_text
from launch.launchers.failures import WorkerFailure
from launch.launchers.presence import Coordinator
from launch.launchers.silence import SilenceGuard
from test_elastic_presence import heard, hello

pytestmark = pytest.mark.timeout(60)

GLOO_TEXT = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
             "closed by peer [127.0.0.1]:41234\nGLHF! \U0001F3D6\ufe0f")


def failure(error: str, traceback: str = "Traceback (most recent call last): ...",
            exitcode: int = 1) -> WorkerFailure:
    return WorkerFailure(rank=5, error=error, traceback=traceback, exitcode=exitcode, pid=99)


@pytest.mark.parametrize("err, line", [
    (failure(GLOO_TEXT), "rank 5 lost a peer: a peer's connection closed"),
    (failure("RuntimeError: Timed out waiting 300000ms for recv"),
     "rank 5 lost a peer: a wait on a peer timed out"),
    (failure("", traceback="", exitcode=-9), "rank 5 was killed by SIGKILL"),
    (failure("", traceback="", exitcode=3), "rank 5 exited with code 3"),
    (failure("ZeroDivisionError: division by zero\nmore"), "rank 5 failed with ZeroDivisionError"),
    (failure("UserError: the checkpoint is damaged; delete it"),
     "rank 5: the checkpoint is damaged; delete it"),
])
def test_a_failed_worker_ends_the_attempt_in_one_short_line(err, line, tmp_path):
    assert attempt_end_reason(err, tmp_path, 0.0) == line


def test_a_diagnosis_quoting_the_transport_keeps_its_words_not_gloos():
    diagnosis = (f"rank 0 (dp 0, tp 0, pp 0, node 0) waited 0.4s at step 6 in TP all_reduce #1 "
                 f"over ranks [0, 1]; every rank arrived, the transport failed: {GLOO_TEXT}"
                 f"; every rank's state: RUN/failure.json")
    line = in_own_words(diagnosis)
    assert line == ("rank 0 (dp 0, tp 0, pp 0, node 0) waited 0.4s at step 6 in TP all_reduce "
                    "#1 over ranks [0, 1]; every rank arrived, the transport failed (a peer's "
                    "connection closed); every rank's state: RUN/failure.json")


def test_the_raw_text_goes_to_the_log_only(tmp_path):
    err = failure(GLOO_TEXT)
    reason = attempt_end_reason(err, tmp_path, 0.0)
    note = keep_raw_text(tmp_path, 0, reason, err)
    assert note == f" (details: {tmp_path / 'train.log'})"
    kept = (tmp_path / "train.log").read_text()
    assert "Connection closed by peer" in kept and "GLHF" in kept and reason in kept


def test_a_silent_member_ends_node_0s_attempt_at_the_silence_timeout():
    """A node that says hello and nothing more: the guard stops node 0's ranks once it has
    been silent for silence_s (not before: the first call finds no workers yet), and names it."""
    coordinator = Coordinator(silence_s=2.0, nnodes=2, on_join=lambda node: None)
    calls, stopped_at, stopped = [], [], threading.Event()

    def stop_ranks() -> int:
        calls.append(1)
        if len(calls) == 1:
            return 0  # the workers do not exist yet: the guard looks again
        stopped_at.append(time.monotonic())
        stopped.set()
        return 4

    silent = hello(coordinator.port, 1)
    try:
        heard(coordinator, 1)
        hello_heard = coordinator.nodes[1].last_heard
        with SilenceGuard(coordinator, 0, [0, 1], stop_ranks) as guard:
            assert stopped.wait(20)
        assert stopped_at[0] - hello_heard >= 2.0  # never before the silence timeout
        assert guard.reason.startswith("node 1 stopped answering: not heard for ")
        assert guard.reason.endswith("(launcher.silence_timeout_s=2)")
    finally:
        silent.close()
        coordinator.close()
