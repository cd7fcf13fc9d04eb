"""The fork server hybrid's workers start from: it imports torch and megatron-core once, in
the background, and every worker forked from it shares them (an 8-rank job pays one torch
import instead of eight).

Apart from ``agent.py`` because the launcher starts it before any agent exists, as soon as
the config has passed its checks (``launch.launchers.run.start_workers_fork_server``), and
stops it when the launcher exits early (``launch.commands.console``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Iterator, Optional, Sequence

from launch.launchers.agent_scope import restored_environ
from launch.launchers.agent_worker import worker_environ

WORKER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "hybrid.model.megatron_adapter",
                  "hybrid.train")
"""Imported once by the fork server, before any worker exists (no torch compute has run).
TorchDynamo is among them because torch's ``Optimizer`` imports it when the first one is built
(about 1 s): once here rather than in every worker; Inductor's compiler is not
(``hybrid.megatron_import``)."""
REAP_TIMEOUT_S = 5.0
"""How long the launcher waits for a helper it ended (the fork server, the resource tracker)
to be gone before it leaves it to init."""
MEGATRON_IMPORT_WARNING = "ignore:Transformer Engine and Apex are not installed"
"""PYTHONWARNINGS for the fork server: megatron-core warns on import that Transformer Engine
and Apex are absent, expected on CPU and noise on a console."""

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
    environ = worker_environ(omp_threads)
    with restored_environ(tuple(environ)), hangup_ignored():
        os.environ.update(environ)
        forkserver.ensure_running()


DEAF_TO = ("SIGHUP", "SIGINT", "SIGTERM")
"""What multiprocessing's helpers (the fork server, its resource tracker) start deaf to. A
SIGTERM to the whole process group (``kill -TERM -PGID``, a scheduler) would otherwise end the
fork server before it reaped the workers it forked, leaving them as zombies for init; the
launcher ends it once its workers are gone (``stop_fork_server``)."""


@contextlib.contextmanager
def hangup_ignored() -> Iterator[None]:
    """Start multiprocessing's helpers (the resource tracker, the fork server) deaf to SIGHUP,
    SIGINT and SIGTERM. A closed terminal sends SIGHUP, and Ctrl-C SIGINT, to the whole process
    group: a tracker that dies of it while workers still unregister their shared memory prints a
    traceback per segment, and a fork server that gets Ctrl-C while it imports torch prints
    one of the import machinery. Only the launcher decides what a signal means (it stops
    the workers and says so in one line).

    The signals are blocked here while a helper starts, and the helpers inherit the block: the
    fork server keeps it (deaf until ``stop_fork_server``'s SIGKILL), the resource tracker
    ignores SIGINT and SIGTERM itself, a worker takes all three back in ``call_entrypoint``.
    They are blocked, never set to SIG_IGN here: setting SIG_IGN discards a signal already
    pending, so a Ctrl-C that arrived as the helpers started was lost and the run went on
    (``test_a_signal_during_start_up_is_one_line[0.5-SIGINT-2]``, once in each of two full
    runs). Blocked, it waits and reaches the launcher's own handler once the helpers run."""
    from multiprocessing import resource_tracker

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = {getattr(signal, name) for name in DEAF_TO}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        resource_tracker.ensure_running()
        # The tracker's own start unblocks SIGINT and SIGTERM when it is done: block again.
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def stop_fork_server() -> None:
    """End this process's fork server, if one runs, without waiting for its imports, and reap
    it: a launcher that exits before starting workers (a refused config) leaves none behind.
    SIGKILL, since the server is deaf to SIGTERM (``DEAF_TO``). By now the agent has stopped
    the workers and the server has reaped them; one that is somehow still alive is not killed
    here: it watches the launcher and ends with it (``agent_worker.die_with_launcher``)."""
    from multiprocessing import forkserver

    # multiprocessing's own stop (closing the "alive" pipe) waits for every worker holding
    # that pipe; the server's pid is the module's own record.
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass  # already gone
    _reap(pid)
    # As multiprocessing forgets a server it found dead: a later start starts a new one.
    os.close(server._forkserver_alive_fd)
    if isinstance(server._forkserver_address, str) and os.path.exists(server._forkserver_address):
        os.unlink(server._forkserver_address)
    server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None


def stop_helpers() -> None:
    """The last thing before this process exits, after an interrupt too (``os._exit`` runs
    no exit hook): multiprocessing's finalizers (they release the semaphores of the agent's
    worker queues, which the resource tracker would otherwise report as leaked, and remove
    its temporary directory), then the fork server and the resource tracker, reaped."""
    import multiprocessing.util

    multiprocessing.util._run_finalizers(0)
    multiprocessing.util._run_finalizers()
    stop_fork_server()
    stop_resource_tracker()


def stop_resource_tracker() -> None:
    """End multiprocessing's resource tracker and reap it: closing its pipe is its stop
    signal. It ends once every process holding that pipe (the fork server, the workers) has,
    after unlinking what they left registered; so this is the last thing before exit."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if fd is None or pid is None:
        return
    try:
        os.close(fd)
    except OSError:
        pass
    tracker._fd = tracker._pid = None
    _reap(pid)


def _reap(pid: int, timeout_s: float = REAP_TIMEOUT_S) -> None:
    """Wait for this process's child ``pid`` to end (``REAP_TIMEOUT_S`` at most), so that it
    leaves no zombie behind."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # reaped already (or not ours)
        if done or time.monotonic() > deadline:
            return
        time.sleep(0.01)

