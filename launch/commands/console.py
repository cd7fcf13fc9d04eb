"""Every console script's entry (``hybrid-train``, ``hybrid-plan``, ...): one line on Ctrl-C or
SIGTERM whenever it comes, and a quiet end when the reader of its output goes away
(``hybrid-ckpt show RUN | head -1``). Handled here once for every command, not per command.

This module must be light: a Ctrl-C while a command imports Hydra and torch (the first second
or two) would otherwise print a traceback of the import machinery. So the signal handlers are
installed before anything else is imported.

The workers' fork server starts as soon as the config has passed its checks
(``launch.launchers.run.start_workers_fork_server``), deaf to Ctrl-C (only this process
decides); the script ends it when it exits, so that a run refused or interrupted after that
leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
BROKEN_PIPE_EXIT = 128 + signal.SIGPIPE  # what a C tool writing into a closed pipe exits with
INTERRUPTED_EXIT = 128 + signal.SIGINT  # Ctrl-C, as a shell reports it


class Stopped(KeyboardInterrupt):
    """A SIGTERM or SIGHUP, raised where the command is, like Ctrl-C's KeyboardInterrupt, so
    that the same clean-ups run (``finally`` blocks, temporary files)."""

    def __init__(self, signal_number: int):
        super().__init__(f"got {signal.Signals(signal_number).name} before any worker started")
        self.signal_number = signal_number


_received: list[int] = []
"""The signals this process got outside the agent's window: a library that swallows the
interrupt (a bare ``except``) must not turn it into a run that goes on."""


def _stop(signal_number: int, frame) -> None:
    _received.append(signal_number)
    for sig in STOP_SIGNALS:  # the first is enough: the clean-up is not interrupted again
        signal.signal(sig, signal.SIG_IGN)
    if signal_number == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signal_number)


def _command(module: str) -> Callable[[], None]:
    def entry() -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, _stop)
        _run(lambda: __import__(module, fromlist=["main"]).main())
    entry.__name__ = module.rsplit(".", 1)[1]
    return entry


def _run(main: Callable[[], None]) -> None:
    from launch.launchers.failures import interrupted_by

    try:
        try:
            main()
        finally:
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
    detail = str(err) or "stopped before any worker started"
    _stop_fork_server()
    logging.shutdown()
    try:
        sys.stdout.flush()
    except OSError:
        pass
    print(f"interrupted: {detail}", file=sys.stderr, flush=True)
    if not _received:
        sys.exit(128 + number)
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


train = _command("launch.commands.train")
plan = _command("launch.commands.plan")
data = _command("launch.commands.data")
ckpt = _command("launch.commands.ckpt")
compare = _command("launch.commands.compare")
generate = _command("launch.commands.generate")
