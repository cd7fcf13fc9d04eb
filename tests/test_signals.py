"""Ctrl-C and SIGTERM at any moment of ``hybrid-train`` and ``hybrid-plan``, through the real
commands: at 0.5, 1.5 and 2.5 s after start (Hydra's compose, the planning, the fork server's
and the workers' start-up) and mid-training. Each ends in exactly one ``interrupted:`` line with
exit status 130 (SIGINT) or 143 (SIGTERM), no traceback from any process, and no process left.

The signal goes to the whole process group, as a terminal's Ctrl-C does: the fork server, its
resource tracker and the workers get it too. Every process the command starts carries a tag
in its environment, so that those re-parented to init after the launcher ended are found too.
A fixed delay after start is what is being tested here, not a synchronisation.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from proc_tree import pids_with_env  # noqa: E402
from test_train_cli import _wait_for  # noqa: E402

BIN = Path(sys.executable).parent
TRAIN, PLAN = str(BIN / "hybrid-train"), str(BIN / "hybrid-plan")
SMALL = ["model=tiny", "data=synthetic", "parallel=single", "parallel.dp=2",
         "train.global_batch=8", "train.timeline_step=0", "optim.warmup_steps=0",
         "train.steps=100000", "train.log_every=1"]
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
REPEATS = range(3)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def _start(cmd: list[str], tag: str) -> subprocess.Popen:
    env = {**os.environ, "HYBRID_SIGNAL_TEST": tag}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def _interrupt(proc: subprocess.Popen, tag: str, sig: int, when) -> tuple[str, str]:
    """Send ``sig`` to ``proc``'s process group once ``when()`` is true; its output."""
    try:
        _wait_for(when, 120, "the moment to send the signal")
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _wait_for(lambda: not _alive_tagged(tag), 30, "every process of the command to end")
    return out, err


def _alive_tagged(tag: str) -> set[int]:
    alive = set()
    for pid in pids_with_env(f"HYBRID_SIGNAL_TEST={tag}"):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _after(seconds: float):
    start = time.monotonic()
    return lambda: time.monotonic() - start >= seconds


def _one_line(proc: subprocess.Popen, out: str, err: str, sig: int) -> None:
    both = out + err
    assert "Traceback" not in both and "Error" not in err, both[-3000:]
    lines = [line for line in err.splitlines() if not line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("interrupted: "), both[-3000:]
    assert proc.returncode == EXIT[sig], (proc.returncode, both[-3000:])


@pytest.mark.parametrize("repeat", REPEATS)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("delay", [0.5, 1.5, 2.5])
def test_a_signal_during_start_up_is_one_line(tmp_path, delay, sig, repeat):
    tag = uuid.uuid4().hex
    proc = _start([TRAIN, *SMALL, f"hydra.run.dir={tmp_path}"], tag)
    out, err = _interrupt(proc, tag, sig, _after(delay))
    _one_line(proc, out, err, sig)


@pytest.mark.parametrize("repeat", REPEATS)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_training_is_one_line(tmp_path, sig, repeat):
    tag = uuid.uuid4().hex
    proc = _start([TRAIN, *SMALL, f"hydra.run.dir={tmp_path}"], tag)
    metrics = tmp_path / "metrics.jsonl"
    out, err = _interrupt(proc, tag, sig, lambda: metrics.exists() and metrics.read_text())
    _one_line(proc, out, err, sig)
    assert "workers were stopped" in err


PLAN_SEARCH = ["model=gpt3-175b", "search.world=1024", "train.global_batch=1536",
               "cost.device=h100-80gb"]
"""A search of 8,400 layouts: about 1.7 s on an idle core, most of it past the first second."""


@pytest.mark.parametrize("repeat", REPEATS)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("delay", [0.5, 1.0])
def test_hybrid_plan_interrupted_while_planning_is_one_line(delay, sig, repeat):
    tag = uuid.uuid4().hex
    proc = _start([PLAN, *PLAN_SEARCH], tag)
    out, err = _interrupt(proc, tag, sig, _after(delay))
    if proc.returncode == 0:
        pytest.fail(f"hybrid-plan finished in under {delay} s: choose a longer search")
    _one_line(proc, out, err, sig)
