"""What a launch that did not finish raises: a failed worker (with the first failure's one-line
error and its traceback tail, from torch elastic's ``ChildFailedError``) or a signal."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

TRACEBACK_TAIL_LINES = 15
AGENT_FRAME_MARK = "torch/distributed/elastic/"
RESTART_MARK = "will restart worker group"
"""What torch elastic's agent logs when it restarts the worker group after a failure."""


class WorkerFailure(RuntimeError):
    """A worker raised or died; every other worker has been stopped.

    ``str(err)`` is ``rank R failed: <error>`` followed by the traceback tail; the parts are
    also attributes: ``rank``, ``error`` (one line), ``traceback`` (may be empty),
    ``exitcode`` (negative: killed by that signal) and ``pid``.
    """

    def __init__(self, *, rank: int, error: str, traceback: str, exitcode: int, pid: int):
        self.rank, self.error, self.traceback = rank, error, traceback
        self.exitcode, self.pid = exitcode, pid
        super().__init__(f"rank {rank} failed: {error}" + (f"\n{traceback}" if traceback else ""))

    @property
    def summary(self) -> str:
        """The one-line form: ``rank R failed: <error>``."""
        return f"rank {self.rank} failed: {self.error}"


class LaunchFailed(RuntimeError):
    """The job did not finish, for a reason already said in one line (``str(err)``): the
    nodes did not meet, a Slurm job failed or was cancelled."""


class WorkerInterrupted(RuntimeError):
    """Raised inside a worker that got SIGINT on its own, so that it counts as a failure."""


class LaunchInterrupted(RuntimeError):
    """The launcher got a termination signal other than SIGINT; all workers were stopped."""

    def __init__(self, signal_number: int, nproc: int):
        self.signal_number = signal_number
        name = signal.Signals(signal_number).name
        super().__init__(f"launcher got {name}; all {nproc} workers were stopped")


def worker_failure_from(err: Any) -> WorkerFailure:
    """Turn the agent's ``ChildFailedError`` into a ``WorkerFailure`` for its first failure."""
    rank, failure = err.get_first_failure()
    message, traceback = failure.message, ""
    if isinstance(message, dict):  # written by @record: {"message": ..., "extraInfo": ...}
        traceback = _tail(message.get("extraInfo", {}).get("py_callstack", ""))
        message = message.get("message", "")
    if failure.exitcode < 0 and not traceback:
        message = (f"killed by signal {failure.signal_name()} "
                   f"(exit code {failure.exitcode}, pid {failure.pid})")
    elif not traceback:
        # No error file: the worker left without a Python exception (sys.exit, os._exit).
        message = f"exited with code {failure.exitcode} (pid {failure.pid})"
    return WorkerFailure(rank=rank, error=str(message).strip(), traceback=traceback,
                         exitcode=failure.exitcode, pid=failure.pid)


def _tail(traceback: str) -> str:
    """The last lines of ``traceback`` without the agent's own wrapper frames."""
    kept, in_agent_frame = [], False
    for line in traceback.rstrip().splitlines():
        if line.startswith("  File "):
            in_agent_frame = AGENT_FRAME_MARK in line.replace(os.sep, "/")
        elif not line.startswith("    "):
            in_agent_frame = False
        if not in_agent_frame:
            kept.append(line)
    return "\n".join(kept[-TRACEBACK_TAIL_LINES:])


def interrupted_by(err: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C behind ``err``, if any: a KeyboardInterrupt that lands inside a library's
    cleanup (OmegaConf restoring its flags while Hydra composes the config) comes back as
    another exception whose context is the interrupt."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


class RestartNotices(logging.Handler):
    """Say on the console that a worker died and the group restarts (torch elastic logs both,
    into ``train.log``). A failure that no restart follows ends the run with its own error
    line instead, so a failure is held until its restart is logged."""

    def __init__(self, first_rank: int, workers_dir: str):
        super().__init__(logging.INFO)
        self.first_rank, self.workers_dir = first_rank, Path(workers_dir)
        self.failed: tuple[int, int] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        text, args = str(record.msg), record.args or ()
        if text.startswith("failed (exitcode") and len(args) >= 2:
            self.failed = (int(args[0]), int(args[1]))
        elif RESTART_MARK in text and "attempts left" in text and len(args) >= 4:
            if self.failed is not None:
                exitcode, local = self.failed
                print(f"warning: rank {self.first_rank + local} died ({exit_text(exitcode)}); "
                      f"its log: {self._log_of(local)}", file=sys.stderr, flush=True)
            print(f"warning: restarting all workers ({args[2]} of {args[3]} restarts left); "
                  f"they resume from the newest checkpoint", file=sys.stderr, flush=True)
            self.failed = None

    def _log_of(self, local_rank: int) -> Path:
        found = sorted(self.workers_dir.glob(f"*/attempt_*/{local_rank}"),
                       key=lambda p: p.stat().st_mtime)
        return found[-1] if found else self.workers_dir


def exit_text(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by signal {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def count_restarts(run_dir: Path, log_name: str = "train.log") -> int:
    """How many times the agent restarted the worker group in this run (from its log)."""
    log = Path(run_dir) / log_name
    if not log.is_file():
        return 0
    return sum(RESTART_MARK in line and "attempts left" in line
               for line in log.read_text(errors="replace").splitlines())
