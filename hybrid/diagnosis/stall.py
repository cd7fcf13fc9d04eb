"""Who waits on whom when a job stalls: one line and ``failure.json`` from the ranks' reports.

Pure (no torch). When a rank's wait fails (a collective or pipeline receive past
``train.collective_timeout_s``), it publishes a *report* and reads the others' for a few
seconds (``hybrid.diagnosis.watch``). A report is a JSON-able dict::

    {"rank": 2, "coords": {"dp": 0, "tp": 0, "pp": 1}, "node": 0, "host": "n1", "step": 4,
     "last_started": "1B3", "last_finished": "1F3",
     "waiting": {"axis": "tp", "op": "all_reduce", "ranks": [2, 3], "seq": 12,
                 "peer": None, "action": None, "waited_s": 20.0},
     "error": "Timed out waiting 20000ms for recv operation to complete"}

``seq`` numbers the collectives a rank issued on that group in this step (every member of a
group issues the same sequence), so two reports name the same collective when step, ranks and
seq agree. ``peer`` and ``action`` are set for a pipeline receive. A rank that sent no report
is stopped, dead, or busy outside any collective: it cannot be asked, which is why it is the
one the others name.
"""

from __future__ import annotations

from typing import Callable, Optional

Report = dict
CoordsOf = Callable[[int], dict]
"""Global rank -> ``{"dp": i, "tp": j, "pp": k}`` (``Layout.coords``)."""

FAILURE_FILE = "failure.json"
"""Written into the run directory by the first rank that finished hearing the others."""
AXIS_NAMES = {"dp": "DP", "cp": "CP", "tp": "TP", "pp": "PP"}
"""How a wait's axis reads in the line; other groups (the world, tp-pp, embedding) by ranks."""


def same_wait(a: Optional[dict], b: Optional[dict]) -> bool:
    """Do two waits name the same collective (pipeline messages have one waiter: never)?"""
    if not a or not b or a.get("peer") is not None or b.get("peer") is not None:
        return False
    return (a["ranks"], a["op"], a["seq"]) == (b["ranks"], b["op"], b["seq"])


def never_arrived(report: Report, reports: dict[int, Report]) -> list[int]:
    """The ranks the wait of ``report`` needed that are not in the same wait.

    A pipeline receive needs its peer; a collective needs every rank of its group. A rank
    that reported the same collective at the same step has arrived.
    """
    wait = report.get("waiting")
    if not wait:
        return []
    if wait.get("peer") is not None:
        return [wait["peer"]]
    step = report["step"]
    return [rank for rank in wait["ranks"] if rank != report["rank"] and not (
        rank in reports and reports[rank]["step"] == step
        and same_wait(reports[rank].get("waiting"), wait))]


def describe_wait(wait: dict) -> str:
    """``TP all_reduce #12 over ranks [2, 3]`` or ``pipeline 1RECV_F3 (micro-batch 3 of
    stage 1) from rank 1``."""
    if wait.get("peer") is not None:
        what = wait.get("action") or wait["op"]
        detail = ""
        if wait.get("action_mb") is not None:
            detail = f" (micro-batch {wait['action_mb']} of stage {wait['action_stage']})"
        direction = "to" if wait["op"] == "send" else "from"
        return f"pipeline {what}{detail} {direction} rank {wait['peer']}"
    axis = AXIS_NAMES.get(wait["axis"])
    return f"{axis + ' ' if axis else ''}{wait['op']} #{wait['seq']} over ranks {wait['ranks']}"


def who(rank: int, coords_of: CoordsOf, node_of: Callable[[int], int]) -> str:
    """``rank 3 (dp 0, tp 1, pp 1, node 0)``."""
    c = coords_of(rank)
    cp = f", cp {c['cp']}" if "cp" in c else ""  # the trainer leaves it out at cp=1
    return f"rank {rank} (dp {c['dp']}{cp}, tp {c['tp']}, pp {c['pp']}, node {node_of(rank)})"


def absent_reason(rank: int, reports: dict[int, Report], coords_of: CoordsOf,
                  node_of: Callable[[int], int], seen: frozenset = frozenset()) -> str:
    """Why ``rank`` is not in the wait: silent, or waiting elsewhere, and then on whom, down
    the chain of waits to the rank that holds everyone up."""
    other = reports.get(rank)
    if other is None:
        return "no report: stopped, dead, or busy outside any collective"
    if not other.get("waiting"):
        return f"at step {other['step']}, not waiting"
    reason = f"itself waiting at step {other['step']} in {describe_wait(other['waiting'])}"
    seen = seen | {rank}
    further = [r for r in never_arrived(other, reports) if r not in seen]
    for r in further:
        reason += (f", where {who(r, coords_of, node_of)} never arrived, "
                   f"{absent_reason(r, reports, coords_of, node_of, seen)}")
    return reason


def stall_line(report: Report, reports: dict[int, Report], coords_of: CoordsOf,
               node_of: Callable[[int], int]) -> str:
    """The one line a stalled job ends with, from the point of view of ``report``'s rank."""
    wait = report["waiting"]
    line = (f"{who(report['rank'], coords_of, node_of)} waited {wait['waited_s']:.1f}s at step "
            f"{report['step']} in {describe_wait(wait)}")
    missing = never_arrived(report, reports)
    seen = frozenset({report["rank"]})
    if missing:
        parts = [f"{who(r, coords_of, node_of)}, "
                 f"{absent_reason(r, reports, coords_of, node_of, seen)}" for r in missing]
        line += "; never arrived: " + "; ".join(parts)
    else:
        line += f"; every rank arrived, the transport failed: {report.get('error', '?')}"
    return line


def failure_document(line: str, reports: dict[int, Report], world: int, coords_of: CoordsOf,
                     node_of: Callable[[int], int]) -> dict:
    """``failure.json``: the line, then per rank its report (or ``reported: false``)."""
    ranks = {}
    for rank in range(world):
        entry = {"coords": coords_of(rank), "node": node_of(rank), "reported": rank in reports}
        if rank in reports:
            got = reports[rank]
            entry.update({key: got.get(key) for key in
                          ("host", "step", "last_started", "last_finished", "waiting", "error")})
        ranks[str(rank)] = entry
    silent = [rank for rank in range(world) if rank not in reports]
    return {"diagnosis": line, "silent_ranks": silent, "ranks": ranks}
