"""Run a function on this node's workers under torch's elastic agent: the machinery behind
every hybrid launcher (``launch/launchers/local.py``, ``launch/launchers/torchrun.py``).

``run_agent(fn, args, nproc=4, rendezvous=..., run_dir=...)`` is ``torchrun`` done in-process:
one agent on this node meets the other nodes' agents (``Rendezvous``), starts ``nproc``
workers with ``spawn`` or ``forkserver`` and gives each the usual torchrun variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) so that it can call
``torch.distributed.init_process_group(backend)`` itself. It returns this node's results.

Failures (``launch/launchers/failures.py``): when a worker raises or dies, the agent stops all the
others and ``run_agent`` raises ``WorkerFailure`` (``rank 3 failed: ValueError: ...`` and the
worker's traceback tail). Ctrl-C stops every worker, then raises ``KeyboardInterrupt``;
SIGTERM, SIGHUP or SIGQUIT stop every worker, then raise ``LaunchInterrupted``. Nodes that do
not meet within the rendezvous timeout raise ``RendezvousFailure``
(``launch/launchers/rendezvous.py``).

A script that calls it needs the ``if __name__ == "__main__":`` guard: spawned workers import
the main module, and without the guard each would launch again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

from launch.launchers.failures import (LaunchInterrupted, RestartNotices, WorkerInterrupted,
                             worker_failure_from)
from launch.launchers.rendezvous import Rendezvous, rendezvous_failure, wait_for_node0

WORKER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "hybrid.model.megatron_adapter",
                  "hybrid.train")
"""Imported once by the fork server, before any worker exists (no torch compute has run).
TorchDynamo is among them because torch's ``Optimizer`` imports it when the first one is built
(about 1 s): once here rather than in every worker; Inductor's compiler is not
(``hybrid.megatron_import``)."""
MEGATRON_IMPORT_WARNING = "ignore:Transformer Engine and Apex are not installed"
"""PYTHONWARNINGS for the fork server: megatron-core warns on import that Transformer Engine
and Apex are absent, expected on CPU and noise on a console."""
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
AGENT_INFO_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                      "torch.distributed.elastic.agent.server.local_elastic_agent")
"""Whose INFO records (workers started, the group restarted) go to ``train.log`` too."""
AGENT_LOG = "train.log"
"""The agent's messages go here, in the run directory (Hydra's log of the launcher too)."""
SHUTDOWN_TIMEOUT_S = 10
"""Seconds workers get to exit after SIGTERM/SIGINT before the agent sends SIGKILL (torch's
default, 30, is long for a worker that is stuck in a collective and cannot see the signal)."""
# The agent replaces these handlers for good and sets these variables in this process;
# run_agent puts them back so the caller's Ctrl-C behaves as before once the run is over.
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
LAUNCHER_PID_ENV = "HYBRID_LAUNCHER_PID"
"""Tells workers which process to watch (see ``_die_with_launcher``)."""
AGENT_ENV_KEYS = ("OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE", LAUNCHER_PID_ENV)
TORCHRUN_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT")


def default_omp_threads(nproc: int) -> int:
    """OMP threads per worker: the CPUs this process may use, shared out, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nproc)


def run_agent(entrypoint: Callable[..., Any], args: Sequence[Any], *, nproc: int,
              rendezvous: Rendezvous = Rendezvous(), omp_threads: Optional[int] = None,
              max_restarts: int = 0, run_dir: str | os.PathLike, start_method: str = "spawn",
              preload: Sequence[str] = (),
              shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S) -> list[Any]:
    """Run ``entrypoint(*args)`` on ``nproc`` workers of this node; return their results in
    rank order.

    ``entrypoint`` must be a module-level function and ``args`` picklable (workers are fresh
    processes). Worker logs and error files go under ``run_dir/workers``. ``omp_threads``
    defaults to ``default_omp_threads(nproc)``. ``max_restarts`` restarts the whole group
    after a failure before giving up. With ``start_method="forkserver"`` the modules named in
    ``preload`` are imported once by the fork server and shared by every worker (an 8-rank job
    then pays one torch import instead of eight). Raises ``WorkerFailure`` when a worker fails,
    ``KeyboardInterrupt`` on Ctrl-C, ``LaunchInterrupted`` on other termination signals.

    Forked workers inherit the fork server's state from when it started (its environment
    and preloaded modules), not the launcher's current one: ``spawn`` is this function's
    default for arbitrary callers; ``hybrid-train`` uses the fork server
    (``launcher.start_method``) and starts it once the config has passed its checks
    (``launch.launchers.run.start_workers_fork_server``), so that its imports overlap the
    launcher's; each worker's OMP_NUM_THREADS comes from the agent.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    _check_options(nproc, omp_threads, start_method)
    config = LaunchConfig(
        nproc_per_node=nproc, max_restarts=max_restarts, **rendezvous.launch_options(),
        start_method=start_method, monitor_interval=0.1, shutdown_timeout=shutdown_timeout_s,
        # Rank 0 speaks on the console; the others into their log files only, so that eight
        # workers' start-up chatter does not bury the progress lines.
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(os.fspath(run_dir), "workers"),
                                    redirects=_quiet_ranks(rendezvous, nproc)))
    wait_for_node0(rendezvous)
    threads = omp_threads if omp_threads is not None else default_omp_threads(nproc)
    if start_method == "forkserver":
        start_fork_server(preload, threads)
    with _hangup_ignored():  # starts the resource tracker (spawned workers use it too)
        pass
    # Workers inherit the launcher's environment when they start, before they import torch.
    with _restored_environ(AGENT_ENV_KEYS), _restored_signal_handlers(), \
            _agent_log_to(os.path.join(os.fspath(run_dir), AGENT_LOG),
                          RestartNotices(rendezvous.node_rank * nproc,
                                         os.path.join(os.fspath(run_dir), "workers"))), \
            _own_error_files():
        os.environ.update(_worker_environ(threads))
        results = _elastic_run(config, rendezvous, nproc, entrypoint, args)
    return [results[rank] for rank in sorted(results)]


def _check_options(nproc: int, omp_threads: Optional[int], start_method: str) -> None:
    """``run_agent``'s arguments (the launchers check the user's config before this)."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be >= 1")
    if omp_threads is not None and omp_threads < 1:
        raise ValueError(f"launcher.omp_threads={omp_threads} must be >= 1, or null for "
                         f"cores / workers")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method={start_method!r} is unsupported; use spawn or "
                         f"forkserver (fork is unsafe once torch has started threads)")


def _elastic_run(config, rendezvous: Rendezvous, nproc: int, entrypoint: Callable[..., Any],
                 args: Sequence[Any]) -> dict:
    """torch's elastic launch of ``entrypoint(*args)``, its failures turned into hybrid's."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        return elastic_launch(config, _call_entrypoint)(entrypoint, *args)
    except ChildFailedError as err:
        raise worker_failure_from(err) from None
    except SignalException as err:
        if err.sigval == signal.SIGINT:
            raise KeyboardInterrupt(f"all {nproc} workers were stopped") from None
        raise LaunchInterrupted(int(err.sigval), nproc) from None
    except (dist.DistStoreError, dist.DistNetworkError) as err:
        if rendezvous.endpoint is None:
            raise  # one node meets on its own free port: not a rendezvous problem
        raise rendezvous_failure(rendezvous, err) from None


def start_fork_server(preload: Sequence[str], omp_threads: Optional[int] = None) -> None:
    """Start this process's fork server now, if it is not running yet: it imports ``preload``
    in the background (torch and megatron-core: 5-7 s on a small machine) while the caller
    goes on, e.g. composing its config or importing torch itself. ``run_agent`` with
    ``start_method="forkserver"`` calls it too. The server keeps the environment it started
    with: ``omp_threads`` (OMP_NUM_THREADS) when known; each worker's own comes from the agent
    and ``hybrid.worker`` applies it. ``stop_fork_server`` ends it."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    environ = _worker_environ(omp_threads)
    with _restored_environ(tuple(environ)), _hangup_ignored():
        os.environ.update(environ)
        forkserver.ensure_running()


@contextlib.contextmanager
def _hangup_ignored() -> Iterator[None]:
    """Start multiprocessing's helpers (the resource tracker, the fork server) deaf to SIGHUP:
    a closed terminal sends it to the whole process group, and a tracker that dies of it while
    workers still unregister their shared memory prints a traceback per segment. The launcher
    keeps its own handler (it stops the workers and says so in one line); an ignored signal
    stays ignored in the helpers and the workers they fork, so each worker takes SIGHUP's
    default back (``_call_entrypoint``)."""
    from multiprocessing import resource_tracker

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
        yield
    finally:
        signal.signal(signal.SIGHUP, saved)


def stop_fork_server() -> None:
    """End this process's fork server, if one runs, without waiting for its imports: a
    launcher that exits before starting workers (a refused config) leaves none behind. Forked
    workers are not its children's children to kill: they live on their own."""
    from multiprocessing import forkserver

    # multiprocessing offers no call for this; the server's pid is the module's own record.
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass  # already gone


def _worker_environ(omp_threads: Optional[int]) -> dict[str, str]:
    threads = {} if omp_threads is None else {"OMP_NUM_THREADS": str(omp_threads)}
    return {**threads, LAUNCHER_PID_ENV: str(os.getpid())}


def _quiet_ranks(rendezvous: Rendezvous, nproc: int) -> dict:
    """Local ranks whose output goes to their log files only: all but global rank 0, which
    speaks on node 0's console (eight workers' start-up chatter would bury the progress)."""
    from torch.distributed.elastic.multiprocessing import Std

    first = 1 if rendezvous.node_rank == 0 else 0
    return {r: Std.ALL for r in range(first, nproc)}


def _call_entrypoint(entrypoint: Callable[..., Any], *args: Any) -> Any:
    """Worker side: run ``entrypoint``; a SIGINT aimed at this worker alone is a failure; a
    SIGHUP ends it (as SIGTERM does).

    torch.multiprocessing treats KeyboardInterrupt in a worker as a clean exit (code 0, no
    return value), after which the agent would wait forever for that worker's result.
    """
    _die_with_launcher()
    # Forked by a fork server deaf to SIGHUP (``_hangup_ignored``), a worker inherits that;
    # but the agent stops the workers with the signal it got itself, and a worker that
    # ignored SIGHUP lived until the SIGKILL after ``shutdown_timeout_s`` (10-12 s late).
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        return entrypoint(*args)
    except KeyboardInterrupt as err:
        raise WorkerInterrupted("got SIGINT and stopped") from err


def _die_with_launcher() -> None:
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


class _QuietFileHandler(logging.FileHandler):
    """A log file that cannot be written (a full disk) must not spray tracebacks on the
    console; the failure it would have described still ends the run with its own line."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


@contextlib.contextmanager
def _agent_log_to(path: str, notices: logging.Handler) -> Iterator[None]:
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
def _own_error_files() -> Iterator[None]:
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
def _restored_environ(keys: Sequence[str]) -> Iterator[None]:
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
def _restored_signal_handlers() -> Iterator[None]:
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


def worker_env_summary() -> str:
    """One line a worker can print: its torchrun variables, e.g. ``RANK=0 WORLD_SIZE=2 ...``."""
    return " ".join(f"{key}={os.environ[key]}" for key in TORCHRUN_ENV_KEYS if key in os.environ)
