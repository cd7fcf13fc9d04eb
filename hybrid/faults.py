"""Faults injected on purpose, for the tests that prove recovery (never set in real runs).

``HYBRID_TEST_FAULT=KIND:STEP:RANK`` makes global rank ``RANK`` SIGKILL itself at ``STEP``
where the code calls ``maybe_die(KIND, ...)``; only in the first attempt of the worker group
(an elastic restart runs clean), so a test can show that a restart recovers.

Kinds: ``die_at_step`` (after the step's optimizer update, before metrics) and
``die_in_save`` (every rank's checkpoint files are written, the manifest is not).
"""

from __future__ import annotations

import os
import signal

ENV = "HYBRID_TEST_FAULT"


def requested(kind: str, *, step: int, rank: int) -> bool:
    value = os.environ.get(ENV)
    if not value or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return False
    want_kind, want_step, want_rank = value.split(":")
    return want_kind == kind and int(want_step) == step and int(want_rank) == rank


def maybe_die(kind: str, *, step: int, rank: int) -> None:
    if requested(kind, step=step, rank=rank):
        os.kill(os.getpid(), signal.SIGKILL)
