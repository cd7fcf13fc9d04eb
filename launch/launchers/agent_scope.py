"""What torch's elastic agent changes in the launcher's own process, and the guards that put
it back once a run is over: its loggers (sent to ``train.log``), signal handlers, environment
variables and the temporary directory of its workers' error files.

Apart from ``agent.py`` because these are the launcher process's housekeeping around a run,
not the run itself: ``run_agent`` enters them all at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterator, Sequence

AGENT_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
AGENT_INFO_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                      "torch.distributed.elastic.agent.server.local_elastic_agent")
"""Whose INFO records (workers started, the group restarted) go to ``train.log`` too."""
# The agent replaces these handlers for good; run_agent puts them back so the caller's Ctrl-C
# behaves as before once the run is over.
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


class _QuietFileHandler(logging.FileHandler):
    """A log file that cannot be written (a full disk) must not spray tracebacks on the
    console; the failure it would have described still ends the run with its own line."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


@contextlib.contextmanager
def agent_log_to(path: str, notices: logging.Handler) -> Iterator[None]:
    """Send torch elastic's own log records (the workers it starts, their failures with
    tracebacks, restarts) to ``path`` instead of the console, where the caller prints one line
    per failure and ``notices`` says when a worker died and the group restarted."""
    loggers = [logging.getLogger(name) for name in AGENT_LOGGERS]
    handler = _QuietFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    propagate = [logger.propagate for logger in loggers]
    told = [logging.getLogger(name) for name in AGENT_INFO_LOGGERS]
    levels = [logger.level for logger in told]
    for logger in told:  # torch sets WARNING on each; its INFO records are the run's story
        logger.setLevel(logging.INFO)
    for logger in loggers:
        logger.addHandler(handler)
        logger.addHandler(notices)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, saved in zip(loggers, propagate):
            logger.removeHandler(handler)
            logger.removeHandler(notices)
            logger.propagate = saved
        for logger, level in zip(told, levels):
            logger.setLevel(level)
        handler.close()


@contextlib.contextmanager
def own_error_files() -> Iterator[None]:
    """torch.multiprocessing passes each worker's traceback back through a file it names in
    the temporary directory (``pytorch-errorfile-*.pickle``) and leaves it behind when the
    worker fails. Name them in a directory of this launch, removed afterwards (the system's
    temporary directory, not the run's, which may be the full disk that failed the run).
    multiprocessing's own temporary directory (the fork server's socket) is fixed first."""
    import multiprocessing.util
    import shutil
    import tempfile

    multiprocessing.util.get_temp_dir()
    directory = tempfile.mkdtemp(prefix="hybrid-launch-")
    saved, tempfile.tempdir = tempfile.tempdir, directory
    try:
        yield
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def restored_environ(keys: Sequence[str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def restored_signal_handlers() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be set from the main thread, so the agent sets none either
        return
    signals = [getattr(signal, name) for name in AGENT_SIGNALS if hasattr(signal, name)]
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

