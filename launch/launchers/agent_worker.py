"""The worker side of torch's elastic agent: what runs first in every worker process
(``call_entrypoint``), the watchdog that ends a worker whose launcher died, and the
environment the launcher hands its workers.

Apart from ``agent.py`` because this code runs in the workers, not in the launcher: the agent
pickles ``call_entrypoint`` by name, and a worker imports only this small module for it.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from typing import Any, Callable, Optional

from launch.launchers.failures import WorkerInterrupted

LAUNCHER_PID_ENV = "HYBRID_LAUNCHER_PID"
"""Tells workers which process to watch (see ``die_with_launcher``)."""
TORCHRUN_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT")


def worker_environ(omp_threads: Optional[int]) -> dict[str, str]:
    threads = {} if omp_threads is None else {"OMP_NUM_THREADS": str(omp_threads)}
    return {**threads, LAUNCHER_PID_ENV: str(os.getpid())}


def call_entrypoint(entrypoint: Callable[..., Any], *args: Any) -> Any:
    """Worker side: run ``entrypoint``; a SIGINT aimed at this worker alone is a failure; a
    SIGHUP or SIGTERM ends it. All three are taken back from the fork server, which starts
    with them blocked (``fork_server.hangup_ignored``) and ignores SIGINT; one that came
    meanwhile was held and comes now.

    torch.multiprocessing treats KeyboardInterrupt in a worker as a clean exit (code 0, no
    return value), after which the agent would wait forever for that worker's result.
    """
    die_with_launcher()
    # Forked by a fork server deaf to these (``hangup_ignored``), a worker inherits that;
    # but the agent stops the workers with the signal it got itself, and a worker that
    # ignored SIGHUP lived until the SIGKILL after ``shutdown_timeout_s`` (10-12 s late).
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP, signal.SIGINT, signal.SIGTERM})
        return entrypoint(*args)
    except KeyboardInterrupt as err:
        raise WorkerInterrupted("got SIGINT and stopped") from err


def _interrupt_once(signal_number: int, frame) -> None:
    """A worker's first SIGINT raises KeyboardInterrupt; later ones are ignored. A terminal's
    Ctrl-C reaches every worker twice, from the terminal and forwarded by the agent: one
    request to stop, and a second KeyboardInterrupt landed in torch's wrapper while it wrote
    the first one's traceback to its error file, which then printed its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def die_with_launcher() -> None:
    """Worker side: SIGKILL this worker as soon as the launcher process is gone.

    A ``kill -9`` of ``hybrid-train`` (the OOM killer, a scheduler) cannot stop its workers
    itself, and the fork server outlives it (every worker holds the pipe whose end would tell
    it), so each worker watches the launcher: a daemon thread blocks on a pidfd of the
    launcher (Linux >= 5.3), which becomes readable when it exits. Elsewhere this does nothing.
    """
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    if not launcher or not hasattr(os, "pidfd_open"):
        return
    try:
        pidfd = os.pidfd_open(launcher)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)  # it died before we started watching
    except OSError:
        return  # no pidfd support in this kernel

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="hybrid-launcher-watchdog", daemon=True).start()


def worker_env_summary() -> str:
    """One line a worker can print: its torchrun variables, e.g. ``RANK=0 WORLD_SIZE=2 ...``."""
    return " ".join(f"{key}={os.environ[key]}" for key in TORCHRUN_ENV_KEYS if key in os.environ)
