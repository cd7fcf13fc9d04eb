"""Why an elastic attempt ended, in hybrid's words: one short line for the console
(``elastic: attempt N ended: ...``), the raw text of the failure (torch's and gloo's
multi-line exception text) kept in the run's ``train.log`` only.

``launch.launchers.elastic`` asks here; ``launch.launchers.silence`` supplies the reason when
node 0 stopped an attempt itself because a node fell silent.
"""

from __future__ import annotations

import signal
from pathlib import Path

from launch.launchers.agent import AGENT_LOG
from launch.launchers.failures import LaunchFailed, WorkerFailure
from launch.launchers.run import WORKER_DIAGNOSES, WORKER_USER_ERROR, stall_diagnosis

CLOSED_MARKS = ("Connection closed by peer", "Connection reset by peer", "Socket closed",
                "unexpectedly closed", "Broken pipe", "Connection refused",
                "Pair is not connected", "Read error")
"""gloo's and the OS's words for a peer whose end of a connection went away."""
TIMEOUT_MARKS = ("Timed out", "timed out", "Read timeout", "Write timeout", "Connect timeout")
TRANSPORT_FAILED = "the transport failed: "
"""Where the hang diagnosis (``hybrid.diagnosis.stall.stall_line``) quotes the transport."""
STATE_MARK = "; every rank's state: "


def transport_phrase(raw: str) -> str:
    """A transport error's raw text as a short phrase."""
    if any(mark in raw for mark in CLOSED_MARKS):
        return "a peer's connection closed"
    if any(mark in raw for mark in TIMEOUT_MARKS):
        return "a wait on a peer timed out"
    return "a transport error"


def in_own_words(diagnosis: str) -> str:
    """A diagnosis line with the transport's raw text it may quote replaced by a phrase."""
    head, found, raw = diagnosis.partition(TRANSPORT_FAILED)
    if not found:
        return diagnosis.splitlines()[0]
    raw, state_found, state = raw.rpartition(STATE_MARK) if STATE_MARK in raw \
        else (raw, "", "")
    return f"{head}the transport failed ({transport_phrase(raw)}){state_found}{state}"


def _error_kind(error: str) -> str:
    """``RuntimeError`` of ``RuntimeError: ...`` (the exception's name, never its text)."""
    kind = error.split(":", 1)[0].strip().rsplit(".", 1)[-1]
    return kind if kind.isidentifier() else "an error"


def worker_end_reason(err: WorkerFailure, run_dir: Path, since: float) -> str:
    """One short line for a failed worker: the stall diagnosis, a user error's own line, or
    which rank ended how."""
    diagnosis = stall_diagnosis(run_dir, since)
    if diagnosis is not None:
        return in_own_words(diagnosis)
    kind, _, text = err.error.partition(":")
    if kind in WORKER_DIAGNOSES:
        return in_own_words(text.strip())
    if kind == WORKER_USER_ERROR:
        return f"rank {err.rank}: {text.strip().splitlines()[0]}"
    if err.exitcode < 0 and not err.traceback:
        return f"rank {err.rank} was killed by {signal.Signals(-err.exitcode).name}"
    if not err.traceback:
        return f"rank {err.rank} exited with code {err.exitcode}"
    if any(mark in err.error for mark in CLOSED_MARKS + TIMEOUT_MARKS):
        return f"rank {err.rank} lost a peer: {transport_phrase(err.error)}"
    return f"rank {err.rank} failed with {_error_kind(err.error)}"


def attempt_end_reason(err: BaseException, run_dir: Path, since: float) -> str:
    """The short line for how an attempt failed (``err``: what the launch raised)."""
    if isinstance(err, WorkerFailure):
        return worker_end_reason(err, run_dir, since)
    if isinstance(err, LaunchFailed):
        return str(err).splitlines()[0]
    return f"{_error_kind(f'{type(err).__name__}:')}"


def keep_raw_text(run_dir: Path, attempt: int, reason: str, err: BaseException) -> str:
    """Append ``err``'s full text to the run's ``train.log`` (where the agent logs); returns
    `` (details: LOG)`` for the console line, or "" when nothing was kept."""
    raw = str(err).strip()
    if not raw or raw == reason:
        return ""
    log = Path(run_dir) / AGENT_LOG
    try:
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"elastic: attempt {attempt} ended: {reason}\nits raw text:\n{raw}\n")
    except OSError:
        return ""
    return f" (details: {log})"
