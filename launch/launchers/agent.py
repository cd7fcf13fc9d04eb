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

import os
import signal
from typing import Any, Callable, Optional, Sequence

from launch.launchers.agent_scope import (agent_log_to, own_error_files, restored_environ,
                                          restored_signal_handlers)
from launch.launchers.agent_worker import LAUNCHER_PID_ENV, call_entrypoint, worker_environ
from launch.launchers.failures import LaunchInterrupted, RestartNotices, worker_failure_from
from launch.launchers.fork_server import hangup_ignored, start_fork_server
from launch.launchers.rendezvous import Rendezvous, rendezvous_failure, wait_for_node0

AGENT_LOG = "train.log"
"""The agent's messages go here, in the run directory (Hydra's log of the launcher too)."""
SHUTDOWN_TIMEOUT_S = 10
"""Seconds workers get to exit after SIGTERM/SIGINT before the agent sends SIGKILL (torch's
default, 30, is long for a worker that is stuck in a collective and cannot see the signal)."""
# The agent sets these variables in this process; run_agent puts them back (and the signal
# handlers: ``agent_scope.AGENT_SIGNALS``) so the caller's Ctrl-C behaves as before once the
# run is over.
AGENT_ENV_KEYS = ("OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE", LAUNCHER_PID_ENV)


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
    with hangup_ignored():  # starts the resource tracker (spawned workers use it too)
        pass
    # Workers inherit the launcher's environment when they start, before they import torch.
    with restored_environ(AGENT_ENV_KEYS), restored_signal_handlers(), \
            agent_log_to(os.path.join(os.fspath(run_dir), AGENT_LOG),
                          RestartNotices(rendezvous.node_rank * nproc,
                                         os.path.join(os.fspath(run_dir), "workers"))), \
            own_error_files():
        os.environ.update(worker_environ(threads))
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
        return elastic_launch(config, call_entrypoint)(entrypoint, *args)
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


def _quiet_ranks(rendezvous: Rendezvous, nproc: int) -> dict:
    """Local ranks whose output goes to their log files only: all but global rank 0, which
    speaks on node 0's console (eight workers' start-up chatter would bury the progress)."""
    from torch.distributed.elastic.multiprocessing import Std

    first = 1 if rendezvous.node_rank == 0 else 0
    return {r: Std.ALL for r in range(first, nproc)}

