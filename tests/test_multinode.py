"""launcher=torchrun failures: two "nodes" on this machine, each its own hybrid-train and
agent, meeting at a rendezvous on 127.0.0.1 (a free port). The two-node training run, compared
with the 1-process losses, is in test_train_e2e.py."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train_cli import _alive, _descendants, _wait_for

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
COMMON = ["model=tiny", "data=synthetic", "train.timeline_step=0", "train.log_every=1000", "seed=3"]

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_command(run_dir: Path, rank: int, endpoint: str, *overrides: str,
                 base: tuple = tuple(COMMON)) -> list[str]:
    return [TRAIN, *base, "launcher=torchrun", "launcher.nnodes=2",
            f"launcher.node_rank={rank}", "launcher.nproc_per_node=4",
            f"launcher.rdzv_endpoint={endpoint}", f"hydra.run.dir={run_dir}", *overrides]


def node(run_dir: Path, rank: int, endpoint: str, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(node_command(run_dir, rank, endpoint, *overrides),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def two_network_namespaces():
    """Two network namespaces joined by a veth pair, 10.77.x.1 and 10.77.x.2; yields
    ``[(namespace, interface, address), ...]`` and deletes both (and the pair) afterwards.
    Yields None where they cannot be made (not root, no ``ip``, no netns support)."""
    tag = f"{os.getpid() % 10000}"
    spaces = [(f"hyb{tag}a", f"hyb{tag}a", f"10.77.{os.getpid() % 250}.1"),
              (f"hyb{tag}b", f"hyb{tag}b", f"10.77.{os.getpid() % 250}.2")]
    made = []

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    try:
        for space, _, _ in spaces:
            ip("netns", "add", space)
            made.append(space)
        ip("link", "add", spaces[0][1], "type", "veth", "peer", "name", spaces[1][1])
        for space, link, address in spaces:
            ip("link", "set", link, "netns", space)
            ip("-n", space, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", space, "link", "set", link, "up")
            ip("-n", space, "link", "set", "lo", "up")
    except (OSError, subprocess.SubprocessError) as err:
        for space in made:
            subprocess.run(["ip", "netns", "del", space], capture_output=True)
        print(f"cannot make network namespaces here (needs root and iproute2): {err}")
        yield None
        return
    try:
        yield spaces
    finally:
        for space in made:  # deleting a namespace deletes its end of the pair, and the pair
            subprocess.run(["ip", "netns", "del", space], capture_output=True)


def stop_all(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            for pid in _descendants(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()


def test_a_missing_node_ends_at_the_rendezvous_timeout_with_one_line(tmp_path):
    """Node 0 alone: the store's count of arrived nodes; node 1 alone: node 0 unreachable
    (two jobs of their own, side by side)."""
    expected, procs = {}, {}
    started = time.monotonic()
    try:
        for rank in (0, 1):
            endpoint = f"127.0.0.1:{free_port()}"
            expected[rank] = (
                rf"rendezvous at {endpoint} timed out after 3s: 1 of 2 nodes arrived; start "
                rf"hybrid-train with launcher.node_rank=1" if rank == 0 else
                rf"node 1 could not reach node 0's rendezvous at {endpoint} within 3s")
            procs[rank] = node(tmp_path / f"alone{rank}", rank, endpoint,
                               "launcher.rdzv_timeout_s=3")
        stderrs = {rank: proc.communicate(timeout=60)[1] for rank, proc in procs.items()}
    finally:
        stop_all(*procs.values())
    for rank, proc in procs.items():
        assert proc.returncode == 1, stderrs[rank][-3000:]
        lines = stderrs[rank].strip().splitlines()  # one line: no C++ frames before it
        assert len(lines) == 1 and re.match(rf"error: {expected[rank]}", lines[0]), \
            stderrs[rank][-3000:]
    assert time.monotonic() - started < 30


def test_an_unreachable_node_0_ends_once_at_the_timeout_not_twice(tmp_path):
    """torch's store client tries again after its own timeout (and prints C++ frames each
    time): node 1 checks node 0's endpoint itself first and ends once, at the timeout."""
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    proc = node(tmp_path / "alone", 1, endpoint, "launcher.rdzv_timeout_s=12")
    try:
        stderr = proc.communicate(timeout=90)[1]
    finally:
        stop_all(proc)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1 and len(stderr.strip().splitlines()) == 1, stderr[-3000:]
    assert f"could not reach node 0's rendezvous at {endpoint} within 12s" in stderr
    assert 12 <= elapsed < 28, elapsed  # the start-up, then 12 s: not the old 30 s or more


def test_killing_one_node_ends_the_other_with_a_diagnosis_and_no_leftovers(tmp_path):
    """SIGKILL of node 1's hybrid-train: its workers die with it; node 0's ranks lose their
    peers, name the ranks that never arrived, and exit; no process of either node stays."""
    endpoint = f"127.0.0.1:{free_port()}"
    extra = ("train.steps=1000", "train.collective_timeout_s=10")
    node1 = node(tmp_path / "node1", 1, endpoint, *extra)
    node0 = node(tmp_path / "node0", 0, endpoint, *extra)
    try:
        metrics = tmp_path / "node0" / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.read_text(), 90, "the first step")
        family = _descendants(node0.pid) | _descendants(node1.pid)
        killed = time.monotonic()
        node1.kill()
        _, stderr = node0.communicate(timeout=60)
        assert time.monotonic() - killed < 10 + 20
    finally:
        stop_all(node0, node1)
    assert node0.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert re.match(r"error: rank \d \(dp \d, tp \d, pp \d, node 0\) waited ", last), last
    assert re.search(r"never arrived: .*rank [4-7] \(dp \d, tp \d, pp \d, node 1\), no report",
                     last), last
    _wait_for(lambda: not any(_alive(pid) for pid in family), 15, "every process to be gone")
