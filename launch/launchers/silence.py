"""Node 0 counts a silent node gone after ``launcher.silence_timeout_s``, not after the
collective timeout (docs/multinode.md).

A stopped node (SIGSTOP, a hung machine, a cut cable) closes no connection: every rank
waiting on it would sit in its collective until ``train.collective_timeout_s`` (300 s by
default). While an attempt runs, ``SilenceGuard`` watches the members' beats on node 0's
``Coordinator``; once a member of the attempt has not been heard for the silence timeout, it
stops node 0's own workers (SIGKILL: they hold nothing a checkpoint does not), so the attempt
ends at once, and says why. The other nodes' ranks see node 0's connections close and end
too; node 0 then regroups as after any failure, the silent node counted gone.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import threading
import time
from typing import Callable, Optional

from launch.launchers.presence import BEAT_S, Coordinator


def silent_member(coordinator: Coordinator, attempt: int, members: list[int]
                  ) -> Optional[str]:
    """``node N stopped answering: ...`` for the first member of ``attempt`` (not node 0)
    silent for the silence timeout while its attempt runs, or None."""
    now = time.monotonic()
    with coordinator.changed:
        for node in sorted(members):
            state = coordinator.nodes.get(node)
            if node == 0 or state is None or state.closed or state.bye is not None \
                    or state.ready >= attempt:
                continue  # gone otherwise (its ranks' connections close), or already done
            silent = now - state.last_heard
            if silent >= coordinator.silence_s:
                return (f"node {node} stopped answering: not heard for {silent:.0f}s "
                        f"(launcher.silence_timeout_s={coordinator.silence_s:g})")
    return None


def stop_local_ranks(endpoint: str, prefixes: list[str], ranks: range,
                     timeout_s: float) -> int:
    """SIGKILL this host's workers of ``ranks``, found by the pids they publish in the job's
    store (``hybrid.diagnosis.watch.publish_pid``) under the newest of ``prefixes`` that
    holds them (one prefix per restart of the group). Returns how many were signalled."""
    from torch.distributed import TCPStore

    from hybrid.diagnosis.watch import PID_KEY

    host, _, port = endpoint.rpartition(":")
    store = TCPStore(host, int(port), None, False, datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False)
    for prefix in reversed(prefixes):
        keys = [f"{prefix}/{PID_KEY(rank)}" for rank in ranks]
        found = [key for key in keys if store.check([key])]
        if not found:
            continue
        stopped = 0
        for key in found:
            where, pid = store.get(key).decode().split()
            if where == socket.gethostname() and int(pid) != os.getpid():
                with contextlib.suppress(OSError):  # it may have ended meanwhile
                    os.kill(int(pid), signal.SIGKILL)
                    stopped += 1
        return stopped
    return 0


def local_rank_stopper(endpoint: str, plan, attempt: int) -> Callable[[], int]:
    """What stops node 0's workers of ``attempt`` (``plan``: its plan; node 0 holds its first
    ``ranks_per_node`` ranks), for ``SilenceGuard``."""
    from hybrid.worker import store_prefix

    launcher = plan.cfg.launcher
    prefixes = [store_prefix(attempt, r) for r in range(launcher.max_restarts + 1)]
    return lambda: stop_local_ranks(endpoint, prefixes, range(plan.ranks_per_node),
                                    launcher.rdzv_timeout_s)


class SilenceGuard:
    """While node 0's attempt runs (a ``with`` block): a silent member ends it
    (``stop_ranks`` stops node 0's workers); ``reason`` then says which node and why."""

    def __init__(self, coordinator: Coordinator, attempt: int, members: list[int],
                 stop_ranks: Callable[[], int]):
        self.coordinator, self.attempt, self.members = coordinator, attempt, members
        self.stop_ranks = stop_ranks
        self.reason: Optional[str] = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True,
                                       name="hybrid-silence")

    def _watch(self) -> None:
        while not self.done.wait(BEAT_S):
            reason = silent_member(self.coordinator, self.attempt, self.members)
            if reason is None:
                continue
            # Before the workers exist (the rendezvous) nothing is stopped: look again.
            if self.stop_ranks():
                self.reason = reason
                return

    def __enter__(self) -> "SilenceGuard":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
