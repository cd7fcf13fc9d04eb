"""Run a function on N gloo processes from an ordinary pytest test.

``spawn(fn, world_size, *args)`` starts ``world_size`` processes, initialises torch.distributed
in each through a file store in a fresh temporary directory (no ports at all), calls
``fn(rank, world_size, *args)`` and returns the per-rank results. If any rank raises, or the
whole job outlives ``timeout`` seconds, every process is killed and ``SpawnError`` carries the
failing rank's traceback, so a hang fails the test instead of blocking the suite.

Processes come from a fork server that imports torch and megatron-core once per test session,
so each job pays fork cost, not import cost, and no process forks after running torch compute.

``hybrid.testing.accounting`` checks a finished run against its plan; ``hybrid.testing.throttle``
slows one worker of a live run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "hybrid.model.megatron_adapter",
           "hybrid.groups"]
"""What the fork server imports once (``launch.launchers.fork_server.WORKER_PRELOAD`` says why)."""
_CONTEXT = None


class SpawnError(RuntimeError):
    """A spawned rank failed or the job timed out."""


def _context():
    global _CONTEXT  # a cache of the fork-server context, not process-group state
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple,
            results: Any, collective_timeout_s: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        out = fn(rank, world_size, *args)
        # Plain pickle copies tensors into the bytes: the queue's own pickler would share
        # them by file descriptor, which the parent can only fetch while this process lives.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt and SystemExit
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results.

    ``fn`` and ``args`` must be picklable (define ``fn`` at module level). Raises
    ``SpawnError`` naming the first failing rank and its traceback, or the timeout.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hybrid-spawn-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, store, fn, args, results, timeout))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout)
        finally:
            _kill(procs)
            results.close()
            results.join_thread()


def barrier_timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes on the slowest rank of the default group (between two
    barriers): what a bench run under ``spawn`` times a collective operation by."""
    import time

    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _collect(procs: list, results: Any, world_size: int, timeout: float) -> list[Any]:
    import time

    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    while len(outputs) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(world_size)) - set(outputs))
            raise SpawnError(f"timed out after {timeout:.0f}s waiting for ranks {missing}")
        try:
            rank, status, payload = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode not in (0, None) and r not in outputs]
            if dead:
                raise SpawnError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            continue
        if status == "error":
            raise SpawnError(f"rank {rank} of {world_size} failed:\n{payload}")
        outputs[rank] = pickle.loads(payload)
    return [outputs[r] for r in range(world_size)]


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def c10d_ops_mode():
    """A torch dispatch mode that lists every ``c10d`` operation dispatched on this thread
    while it is active: what torch itself saw, whoever issued it (``.ops``, by name). The tests
    compare it with what hybrid's groups counted, to show that nothing bypasses them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class C10dOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    return C10dOps()
