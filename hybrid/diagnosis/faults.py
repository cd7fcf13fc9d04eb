"""Faults injected on purpose, for the tests that prove recovery and diagnosis (never set in
real runs).

``HYBRID_TEST_FAULT=KIND:STEP:RANK[:SECONDS]`` acts on global rank ``RANK`` at ``STEP``
where the code asks for ``KIND``; only in the first attempt of the worker group (an elastic
restart runs clean), so a test can show that a restart recovers.

Kinds:

- ``die_at_step``: SIGKILL after the step's optimizer update, before metrics;
- ``die_in_save``: SIGKILL once every rank's checkpoint files are written, the manifest not;
- ``stall_tp``, ``stall_dp``, ``stall_pp``: SIGSTOP (the process stays, stopped) just before
  issuing the step's first operation on that axis: a TP collective, the DP gradient
  reduction, a pipeline send or receive;
- ``slow``: from ``STEP`` on, sleep ``SECONDS`` (default 0.5) in every step's compute.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

ENV = "HYBRID_TEST_FAULT"
STALL_KINDS = {"stall_tp": "tp", "stall_dp": "dp", "stall_pp": "pp"}


def _fault() -> Optional[tuple[str, int, int, float]]:
    """``(kind, step, rank, seconds)`` asked for in this attempt, or None."""
    value = os.environ.get(ENV)
    if not value or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    kind, step, rank, *rest = value.split(":")
    return kind, int(step), int(rank), float(rest[0]) if rest else 0.5


def requested(kind: str, *, step: int, rank: int) -> bool:
    fault = _fault()
    return fault is not None and fault[:3] == (kind, step, rank)


def maybe_die(kind: str, *, step: int, rank: int) -> None:
    if requested(kind, step=step, rank=rank):
        os.kill(os.getpid(), signal.SIGKILL)


def stall_request(rank: int) -> Optional[tuple[str, int]]:
    """``(axis, step)`` at which this rank is asked to stop itself, or None. Read once, so the
    per-operation check costs a comparison."""
    fault = _fault()
    if fault is None or fault[0] not in STALL_KINDS or fault[2] != rank:
        return None
    return STALL_KINDS[fault[0]], fault[1]


def stall_now() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def slow_seconds(rank: int) -> Optional[tuple[int, float]]:
    """``(first step, seconds)`` this rank is asked to sleep per step, or None (read once)."""
    fault = _fault()
    if fault is None or fault[0] != "slow" or fault[2] != rank:
        return None
    return fault[1], fault[3]
