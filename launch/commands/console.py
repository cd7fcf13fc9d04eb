"""Every console script's entry (``hybrid-train``, ``hybrid-plan``, ...): one line on Ctrl-C or
SIGTERM whenever it comes, and a quiet end when the reader of its output goes away
(``hybrid-ckpt show RUN | head -1``). Handled here once for every command, not per command.

This module must be light: a Ctrl-C while a command imports Hydra and torch (the first second
or two) would otherwise print a traceback of the import machinery. So the signal handlers are
installed before anything else is imported.

The workers' fork server starts as soon as the config has passed its checks
(``launch.launchers.run.start_workers_fork_server``), deaf to Ctrl-C (only this process
decides); the script ends it when it exits, and waits for it and multiprocessing's resource
tracker, so that a run refused or interrupted after that leaves nothing behind, not even a
zombie for init to reap.

Two windows need more than raising where the command is:
- **A native import** (torch's, 2-10 s): an exception raised in Python code that torch's C++
  called back aborts the process (``terminate called after throwing an instance of
  'pybind11::error_already_set'``, exit 134). A signal that lands there is held, and raised
  as soon as the import is done (``_hold``).
- **The end**: once a command's work is done (``work_done``, or its main has returned), a
  signal is noted, not raised: there is nothing left to stop, and raising it in a library's
  exit hook printed a traceback. The command ends with its own status (0 for a finished run).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
BROKEN_PIPE_EXIT = 128 + signal.SIGPIPE  # what a C tool writing into a closed pipe exits with
INTERRUPTED_EXIT = 128 + signal.SIGINT  # Ctrl-C, as a shell reports it


class Stopped(KeyboardInterrupt):
    """A SIGTERM or SIGHUP, raised where the command is, like Ctrl-C's KeyboardInterrupt, so
    that the same clean-ups run (``finally`` blocks, temporary files)."""

    def __init__(self, signal_number: int):
        # Not "before any worker started": between a sweep's cells or an elastic job's
        # attempts, workers have run and ended.
        super().__init__(f"got {signal.Signals(signal_number).name} while no worker was running")
        self.signal_number = signal_number


NATIVE_PACKAGES = ("torch",)
"""Packages whose import runs Python code called back from C++ (pybind11), where an exception
raised by a signal handler aborts the process instead of unwinding."""
HELD_POLL_S = 0.02
"""How often a held signal looks whether the native import is over."""

_received: list[int] = []
"""The signals this process got outside the agent's window: a library that swallows the
interrupt (a bare ``except``) must not turn it into a run that goes on."""
_done: list[bool] = []
"""Set once the command's work is done (``work_done``): a signal from then on stops nothing."""
_holding = threading.Lock()
"""Held while a thread waits for a native import to end before raising a held signal."""


def _stop(signal_number: int, frame) -> None:
    if _done:
        return  # nothing left to stop: the command ends with its own status
    _received.append(signal_number)
    if _inside_native_import(frame):
        _hold(signal_number)
        return
    for sig in STOP_SIGNALS:  # the first is enough: the clean-up is not interrupted again
        signal.signal(sig, signal.SIG_IGN)
    if signal_number == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signal_number)


def _inside_native_import(frame) -> bool:
    """Whether ``frame`` runs inside the module code of a ``NATIVE_PACKAGES`` import."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and \
                frame.f_globals.get("__name__", "").partition(".")[0] in NATIVE_PACKAGES:
            return True
        frame = frame.f_back
    return False


def _hold(signal_number: int) -> None:
    """Raise ``signal_number`` in the main thread once its native import is over: a thread
    watches the main thread's stack, then sends the signal to the main thread again (a real
    signal, so that a blocking call there is interrupted too). Another signal meanwhile is
    the same request."""
    if not _holding.acquire(blocking=False):
        return
    import time

    main = threading.main_thread().ident

    def release() -> None:
        try:
            while _inside_native_import(sys._current_frames().get(main)):
                time.sleep(HELD_POLL_S)
        finally:
            _holding.release()
        signal.pthread_kill(main, signal_number)

    threading.Thread(target=release, name="hybrid-held-signal", daemon=True).start()


def raise_if_interrupted() -> None:
    """Raise ``Stopped`` for a signal this process already got: called just before workers
    start, so that an interrupt a library swallowed on its way (a bare ``except``, a
    finalizer that prints "Exception ignored") cannot turn into a run that goes on (in a
    full suite run under load, a Ctrl-C at 0.5 s was once followed by 90 s of training)."""
    if _received and not _done:
        raise Stopped(_received[0])


def work_done() -> None:
    """The command's work is done and saved (a run's workers have all returned): a signal from
    here on is noted, not raised, and the command ends as it would have (exit status 0 for a
    finished run). Stopping nothing, it must not claim that it interrupted anything."""
    _done.append(True)


def _command(module: str) -> Callable[[], None]:
    def entry() -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, _stop)
        # Registered before multiprocessing's own exit hook, so run after it (atexit runs
        # last-in first-out): its finalizers still reach the resource tracker.
        atexit.register(_stop_helpers)
        _run(lambda: __import__(module, fromlist=["main"]).main())
    entry.__name__ = module.rsplit(".", 1)[1]
    return entry


def _run(main: Callable[[], None]) -> None:
    from launch.launchers.failures import interrupted_by

    try:
        try:
            main()
        finally:
            work_done()  # the outcome is decided: a signal now must not change it (exit hooks)
            sys.stdout.flush()  # a closed pipe is seen here, inside the handlers below
    except BrokenPipeError:
        _quiet_exit(BROKEN_PIPE_EXIT)
    except KeyboardInterrupt as err:
        _report_interrupt(err)
    except Exception as err:
        interrupt = interrupted_by(err)
        if interrupt is None and not _received:
            raise
        _report_interrupt(interrupt or Stopped(_received[0]))
    finally:
        _stop_fork_server()
    if _received:  # an interrupt that a library swallowed
        _report_interrupt(Stopped(_received[0]))


def _report_interrupt(err: KeyboardInterrupt) -> None:
    """``interrupted: <what was stopped>``; exit status 128 + the signal (130 for Ctrl-C,
    143 for SIGTERM).

    An interrupt that this module's handler raised may have landed anywhere (inside torch's
    import, a library's clean-up): the process then ends here, logs flushed, without the
    interpreter's own shutdown and exit hooks, which could print or abort on a half-imported
    module. One the agent raised (its workers were stopped) lands in torch's own code, and
    the exit hooks must run: they release the semaphores of torch's worker queues."""
    import logging

    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    number = getattr(err, "signal_number", signal.SIGINT)
    detail = str(err) or "stopped while no worker was running"
    _stop_fork_server()
    logging.shutdown()
    try:
        sys.stdout.flush()
    except OSError:
        pass
    print(f"interrupted: {detail}", file=sys.stderr, flush=True)
    if not _received:
        sys.exit(128 + number)
    _stop_helpers()  # no exit hooks run after os._exit
    os._exit(128 + number)


def _quiet_exit(code: int) -> None:
    """The reader went away: nothing more to say, and nobody to say it to. stdout points at
    /dev/null so that the interpreter's last flush does not complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(code)


def _stop_fork_server() -> None:
    if "launch.launchers.fork_server" in sys.modules:  # nothing started it otherwise
        sys.modules["launch.launchers.fork_server"].stop_fork_server()


def _stop_helpers() -> None:
    """The fork server and the resource tracker, ended and reaped: the last thing before the
    process exits (the tracker outlives every worker and hears their last words)."""
    if "launch.launchers.fork_server" in sys.modules:
        sys.modules["launch.launchers.fork_server"].stop_helpers()


train = _command("launch.commands.train")
plan = _command("launch.commands.plan")
data = _command("launch.commands.data")
ckpt = _command("launch.commands.ckpt")
compare = _command("launch.commands.compare")
generate = _command("launch.commands.generate")
