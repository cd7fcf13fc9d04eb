"""One worker of a live local ``hybrid-train`` slowed from outside, as a throttled node or a
noisy neighbour would slow it: its pid found under the launcher, then SIGSTOP and SIGCONT in
turn (``Throttle``, ``run_throttled``).

Apart from ``hybrid.testing`` (processes for a test) because this disturbs a real run's
processes through ``/proc`` and signals; the replica-balance tests and ``bench/dp_balance.py``
use it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional, Sequence


def worker_pid(launcher_pid: int, rank: int) -> Optional[int]:
    """The pid of global rank ``rank``'s worker (``rank >= 1``) under a local
    ``hybrid-train`` (None until it runs): ranks above 0 write into
    ``workers/<run>/attempt_<n>/<rank>/stdout.log`` (rank 0, to the console, is not told
    apart from the agent's helpers this way)."""
    import re
    from pathlib import Path

    if rank < 1:
        raise ValueError(f"rank={rank}: only the workers of ranks >= 1 are found by their log")
    workers: dict[int, int] = {}
    for pid in _descendants(launcher_pid):
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) \
                    == launcher_pid:
                continue  # the agent's own helpers, not workers
            out = os.readlink(f"/proc/{pid}/fd/1")
        except (OSError, ValueError):
            continue
        found = re.search(r"attempt_\d+/(\d+)/", out)
        if found:
            workers[int(found[1])] = pid
    return workers.get(rank)


def _descendants(pid: int) -> set[int]:
    from pathlib import Path

    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = map(int, (task / "children").read_text().split())
            except OSError:
                continue
            for child in children:
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


class Throttle:
    """Stops and continues a process from outside, again and again (SIGSTOP ``stop_s``,
    SIGCONT ``run_s``): a worker at ``run_s / (stop_s + run_s)`` of its speed, as a throttled
    node or a noisy neighbour makes it. Its waits are the disturbance's duty cycle itself."""

    def __init__(self, pid: int, stop_s: float = 0.02, run_s: float = 0.02):
        import threading

        self.pid, self.stop_s, self.run_s = pid, stop_s, run_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._cycle, daemon=True)

    def _cycle(self) -> None:
        import signal

        while not self.done.is_set():
            try:
                os.kill(self.pid, signal.SIGSTOP)
                self.done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self.done.wait(self.run_s)
            except ProcessLookupError:
                return

    def __enter__(self) -> "Throttle":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import signal

        self.done.set()
        self.thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def run_throttled(cmd: Sequence[str], *, rank: int, timeout: float, stop_s: float = 0.02,
                  run_s: float = 0.02, env: Optional[dict] = None):
    """Run ``cmd`` (a local ``hybrid-train``) with global rank ``rank``'s worker throttled
    from the moment it exists to the end (``Throttle``); returns the ``CompletedProcess``.
    Past ``timeout`` the command and its family are killed."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        deadline = time.monotonic() + timeout
        pid = None
        while pid is None and proc.poll() is None and time.monotonic() < deadline:
            pid = worker_pid(proc.pid, rank)
            if pid is None:
                time.sleep(0.05)  # polling for the worker to exist, with a deadline
        if pid is None:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        else:
            with Throttle(pid, stop_s, run_s):
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            for child in _descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            proc.kill()
            proc.wait()
