"""``RankWatch``: what this rank is doing and waiting on, how long it waited per axis, and the
diagnosis when a wait fails.

hybrid's groups (``hybrid.comm.Group``, through the step's ``CommCounter``) tell the watch
about every collective this rank issues: a synchronous one is waited on right there, timed;
an asynchronous one (the DP buckets) is timed where the gradient sync waits for it
(``wait_async``). The pipeline runtime tells it which action runs and which RECV it waits on.
Per step that gives the seconds blocked per axis (the straggler figures; on CPU/gloo, where a
wait blocks the process) and, when a wait fails past ``train.collective_timeout_s``, exactly
which operation it was:
``stall_error`` then publishes this rank's report on the job's store, reads the others' for a
few seconds and words the line of ``hybrid.diagnosis.stall`` (the stalled rank is the one that never
reports). torch's flight recorder was the first choice; on gloo it records collectives but
neither point-to-point operations nor group members, and its entries never leave
"scheduled", so it cannot say who never arrived. ``Work.wait`` itself is not wrapped: a
Python wrapper around it costs about 0.25 ms per wait on gloo (measured: a 64 KiB all-reduce
on 2 ranks, 0.99 -> 1.25 ms).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from hybrid.diagnosis import faults
from hybrid.comm import RECV, SEND
from hybrid.files import write_text
from hybrid.planning.schedules.actions import Action
from hybrid.diagnosis.stall import FAILURE_FILE, CoordsOf, failure_document, stall_line
from hybrid.diagnosis.stragglers import WAIT_AXES

REPORT_GRACE_S = 5.0
"""How long a failed rank waits for the others' reports before it stops: every rank blocked
on the same stalled one times out within about one step of the first."""


class StallError(RuntimeError):
    """A wait of this rank failed; the message says who waited on whom (``hybrid.diagnosis.stall``)."""


class RankWatch:
    """This rank's progress and waits; fed by ``CommCounter.track``, the runtime and the
    gradient sync. ``enabled=False`` leaves every operation as it is (see the bench)."""

    def __init__(self, rank: int, enabled: bool = True):
        self.rank, self.enabled = rank, enabled
        self.step = 0
        self.last_started: Optional[Action] = None
        self.last_finished: Optional[Action] = None
        self.waiting: Optional[dict] = None
        """What this rank is blocked on now, with ``since`` (``time.perf_counter()``)."""
        self.wait_s = dict.fromkeys(WAIT_AXES, 0.0)
        self._seq: dict[int, int] = {}  # id(group) -> collectives issued this step
        self._issued: dict[int, dict] = {}  # id(async work) -> its description, until waited
        self._stall = faults.stall_request(rank)
        self._thread = threading.current_thread()

    # ----- fed by the training loop and the runtime ------------------------------------------
    def start_step(self, step: int) -> None:
        self.step = step
        self.wait_s = dict.fromkeys(WAIT_AXES, 0.0)
        self.waiting = None
        self._seq.clear()
        self._issued.clear()

    def started(self, action: Action, peer: Optional[int] = None) -> None:
        """An action starts; for a RECV (or a SEND that failed), ``peer`` (global rank) is the
        other end."""
        self.last_started = action
        if peer is not None and self.enabled:
            op = "send" if action.kind.startswith("SEND") else "recv"
            self.waiting = {"axis": "pp", "op": op, "ranks": [peer], "seq": None,
                            "peer": peer, "action": str(action), "action_stage": action.stage,
                            "action_mb": action.mb, "since": time.perf_counter()}

    def finished(self, action: Action) -> None:
        self.last_finished = action
        if self.waiting is not None and self.waiting["peer"] is not None:
            self._done_waiting()

    # ----- fed by hybrid's groups (hybrid.comm) and the gradient sync ------------------------
    def before_issue(self, axis: str) -> None:
        if self._stall is not None and self._stall == (axis, self.step):
            self._stall = None
            faults.stall_now()

    def issued(self, work: Any, axis: str, op: str, group: Any, waits: bool) -> Any:
        """A collective was issued on ``group`` (a ``hybrid.comm.Group``). One its caller
        waits for at once (``waits``) is waited here, timed and described; an asynchronous
        one is described for ``wait_async``. Point-to-point traffic is the runtime's
        (``started``)."""
        if work is None or not self.enabled or threading.current_thread() is not self._thread:
            return work
        self._seq[id(group)] = self._seq.get(id(group), 0) + 1
        wait = self._collective(axis, op, group)
        if waits:
            self._timed_wait(work, wait)  # the caller's own wait then returns at once
        else:
            self._issued[id(work)] = wait  # the id only: a reference would keep its buffers
        return work

    def issue_failed(self, axis: str, op: str, group: Any, peer: Optional[int]) -> None:
        """Issuing an operation raised (its peer's connection is already closed); ``peer``:
        the global rank at the other end of a point-to-point message."""
        if not self.enabled or self.waiting is not None:
            return
        if op in (SEND, RECV):
            wait = {"axis": axis, "op": op, "ranks": [peer], "seq": None, "peer": peer,
                    "action": None}
        else:  # the collective it would have been
            self._seq[id(group)] = self._seq.get(id(group), 0) + 1
            wait = self._collective(axis, op, group)
        self.waiting = dict(wait, since=time.perf_counter())

    def _collective(self, axis: str, op: str, group: Any) -> dict:
        """The description of this step's latest collective on ``group``."""
        return {"axis": axis, "op": op, "ranks": group.ranks, "seq": self._seq[id(group)],
                "peer": None, "action": None}

    def wait_async(self, work: Any) -> None:
        """``work.wait()`` for an asynchronous collective (the DP buckets), timed."""
        wait = self._issued.pop(id(work), None)
        if wait is None or not self.enabled:
            work.wait()
            return
        self._timed_wait(work, wait)

    def _timed_wait(self, work: Any, wait: dict) -> None:
        self.waiting = dict(wait, since=time.perf_counter())
        work.wait()  # raises past the group's timeout, leaving self.waiting set
        self._done_waiting()

    def _done_waiting(self) -> None:
        self.wait_s[self.waiting["axis"]] += time.perf_counter() - self.waiting["since"]
        self.waiting = None

    # ----- when a wait fails -----------------------------------------------------------------
    def failed_wait(self) -> Optional[dict]:
        """After an exception: the wait it came out of (None: it did not come from a wait)."""
        if self.waiting is None:
            return None
        failed = {key: value for key, value in self.waiting.items() if key != "since"}
        return dict(failed, waited_s=time.perf_counter() - self.waiting["since"])

    def report(self, error: BaseException, coords: dict, node: int, host: str) -> dict:
        return {"rank": self.rank, "coords": coords, "node": node, "host": host,
                "step": self.step, "waiting": self.failed_wait(),
                "last_started": _text(self.last_started),
                "last_finished": _text(self.last_finished),
                "error": (str(error).strip().splitlines() or [type(error).__name__])[-1][:300]}


def _text(action: Optional[Action]) -> Optional[str]:
    return None if action is None else str(action)


PID_KEY = "hybrid/pid/rank_{}".format


def publish_pid(store: Optional[dist.Store], rank: int, host: str) -> None:
    """Tell the job where this rank runs, so that a diagnosed stall can stop it."""
    if store is not None:
        store.set(PID_KEY(rank), f"{host} {os.getpid()}")


def stop_silent_ranks(store: Optional[dist.Store], silent: list[int], host: str) -> None:
    """SIGKILL the silent ranks that run on this host.

    A stopped or hung process cannot act on the agent's SIGTERM, and torch's agent then waits
    30 s before its SIGKILL; the job is failing anyway, so end it now. Ranks on other hosts
    are left to their own node's agent.
    """
    for rank in silent:
        try:
            where, pid = store.get(PID_KEY(rank)).decode().split()
        except (AttributeError, RuntimeError, ValueError):
            continue  # no store, or that rank never started
        if where == host and int(pid) != os.getpid():
            with contextlib.suppress(OSError):  # it may have gone meanwhile
                os.kill(int(pid), signal.SIGKILL)


def exchange_reports(store: Optional[dist.Store], report: dict, world: int,
                     grace_s: float) -> tuple[dict[int, dict], bool]:
    """Publish ``report`` and read every rank's for up to ``grace_s`` seconds.

    Returns ``(reports by rank, first)``; ``first`` is True for the one rank that finished
    reading first (it writes ``failure.json``). Without a store, or when the store itself is
    gone, only this rank's report is known.
    """
    me = report["rank"]
    if store is None:
        return {me: report}, True
    key = "hybrid/stall/rank_{}".format
    seen = {me: report}
    try:
        store.set_timeout(timedelta(seconds=grace_s))
        store.set(key(me), json.dumps(report))
        deadline = time.monotonic() + grace_s
        while len(seen) < world:
            for rank in range(world):
                if rank not in seen and store.check([key(rank)]):
                    seen[rank] = json.loads(store.get(key(rank)))
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)  # polling a store with a deadline: reports arrive as ranks fail
        first = store.add("hybrid/stall/finished", 1) == 1
    except (RuntimeError, OSError):  # the store's host stopped too (e.g. a rank hosting it)
        return seen, True
    return seen, first


def stall_error(watch: RankWatch, error: BaseException, *, coords_of: CoordsOf,
                node_of: Callable[[int], int], world: int, host: str,
                store: Optional[dist.Store], run_dir: Path,
                grace_s: float = REPORT_GRACE_S) -> StallError:
    """The diagnosed error for a failed wait of ``watch``'s rank (see the module doc)."""
    me = watch.rank
    report = watch.report(error, coords_of(me), node_of(me), host)
    reports, first = exchange_reports(store, report, world, grace_s)
    line = stall_line(report, reports, coords_of, node_of)
    path = run_dir / FAILURE_FILE
    if first:
        document = failure_document(line, reports, world, coords_of, node_of)
        try:
            write_text(path, json.dumps(document, indent=1) + "\n")
        except OSError:
            pass  # the diagnosis line is what matters; a full disk must not hide it
        stop_silent_ranks(store, document["silent_ranks"], host)  # after the file: see launch
    return StallError(f"{line}; every rank's state: {path}")
