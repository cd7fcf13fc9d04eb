"""Run a function on N gloo processes from an ordinary pytest test.

``spawn(fn, world_size, *args)`` starts ``world_size`` processes, initialises torch.distributed
in each through a file store in a fresh temporary directory (no ports at all), calls
``fn(rank, world_size, *args)`` and returns the per-rank results. If any rank raises, or the
whole job outlives ``timeout`` seconds, every process is killed and ``SpawnError`` carries the
failing rank's traceback, so a hang fails the test instead of blocking the suite.

Processes come from a fork server that imports torch and megatron-core once per test session,
so each job pays fork cost, not import cost, and no process forks after running torch compute.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

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


def train_checked(overrides: list[str], run_dir, timeout: float = 280) -> list[dict]:
    """Run ``hybrid-train`` with ``overrides`` in ``run_dir``; it must succeed; its
    ``metrics.jsonl`` records after ``checked_records``' accounting checks."""
    import subprocess
    import sys
    from pathlib import Path

    train = str(Path(sys.executable).parent / "hybrid-train")
    done = subprocess.run([train, *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return checked_records(run_dir)


def checked_records(run_dir) -> list[dict]:
    """A finished run's ``metrics.jsonl`` records, after checking its accounting: every rank
    held exactly the weight, gradient, optimizer and DP-option bytes the plan predicts, and
    under ZeRO-3 at its peak exactly the gathered weights it predicts (``memory_check.json``),
    and rank 0 sent over DP in each step exactly the bytes
    ``hybrid.planning.job.rank_dp_bytes`` predicts for its layout and DP options, and over its
    context group what ``hybrid.planning.cost.context_time.cp_step_bytes`` predicts; and the run
    directory's ``plan.json`` is the plan of its ``config.json`` (nothing written back)."""
    import json
    from pathlib import Path

    from hybrid.metrics import read_metrics
    from hybrid.planning.config import from_dict
    from hybrid.planning.cost.context_time import cp_step_bytes
    from hybrid.planning.job import plan_job, rank_dp_bytes
    from hybrid.planning.plan_file import load_plan

    run_dir = Path(run_dir)
    check = json.loads((run_dir / "memory_check.json").read_text())
    assert check["state_bytes_equal"], [r for r in check["ranks"]
                                        if r["counted"] != r["predicted"]][:2]
    assert check["gathered_bytes_equal"], [
        r for r in check["ranks"]
        if r["gathered_peak_bytes"] != r["predicted_gathered_bytes"]][:2]
    plan = load_plan(run_dir)
    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    assert plan.cfg == cfg and plan.stages == plan_job(cfg, block_costs=plan.block_costs).stages
    records = read_metrics(run_dir / "metrics.jsonl")
    layers = [b for st in plan.stages_of(0) for b in st.blocks if 1 <= b <= cfg.model.layers]
    ring = cp_step_bytes(cfg, plan.layout, len(layers), plan.schedule.microbatches,
                         moe_layers=sum(cfg.model.is_moe_layer(b) for b in layers))
    for record in records:
        predicted = rank_dp_bytes(cfg, plan, 0, record["step"],
                                  rounds=max(record.get("dp_shares", [0])) or None)
        assert abs(record["comm_bytes"]["dp"] - predicted) <= 1e-9 * predicted, \
            (record["step"], record["comm_bytes"]["dp"], predicted)
        assert record["comm_bytes"]["cp"] == ring, (record["step"], record["comm_bytes"], ring)
    return records


def worker_pid(launcher_pid: int, rank: int) -> Optional[int]:
    """The pid of global rank ``rank``'s worker (``rank >= 1``) under a local
    ``hybrid-train`` (None until it runs): ranks above 0 write into
    ``workers/<run>/attempt_<n>/<rank>/stdout.log`` (rank 0, to the console, is not told
    apart from the agent's helpers this way)."""
    import re
    from pathlib import Path

    if rank < 1:
        raise ValueError(f"rank={rank}: only the workers of ranks >= 1 are found by their log")
    workers: dict[int, int] = {}
    for pid in _descendants(launcher_pid):
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) \
                    == launcher_pid:
                continue  # the agent's own helpers, not workers
            out = os.readlink(f"/proc/{pid}/fd/1")
        except (OSError, ValueError):
            continue
        found = re.search(r"attempt_\d+/(\d+)/", out)
        if found:
            workers[int(found[1])] = pid
    return workers.get(rank)


def _descendants(pid: int) -> set[int]:
    from pathlib import Path

    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = map(int, (task / "children").read_text().split())
            except OSError:
                continue
            for child in children:
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


class Throttle:
    """Stops and continues a process from outside, again and again (SIGSTOP ``stop_s``,
    SIGCONT ``run_s``): a worker at ``run_s / (stop_s + run_s)`` of its speed, as a throttled
    node or a noisy neighbour makes it. Its waits are the disturbance's duty cycle itself."""

    def __init__(self, pid: int, stop_s: float = 0.02, run_s: float = 0.02):
        import threading

        self.pid, self.stop_s, self.run_s = pid, stop_s, run_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._cycle, daemon=True)

    def _cycle(self) -> None:
        import signal

        while not self.done.is_set():
            try:
                os.kill(self.pid, signal.SIGSTOP)
                self.done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self.done.wait(self.run_s)
            except ProcessLookupError:
                return

    def __enter__(self) -> "Throttle":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import signal

        self.done.set()
        self.thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def run_throttled(cmd: Sequence[str], *, rank: int, timeout: float, stop_s: float = 0.02,
                  run_s: float = 0.02, env: Optional[dict] = None):
    """Run ``cmd`` (a local ``hybrid-train``) with global rank ``rank``'s worker throttled
    from the moment it exists to the end (``Throttle``); returns the ``CompletedProcess``.
    Past ``timeout`` the command and its family are killed."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        deadline = time.monotonic() + timeout
        pid = None
        while pid is None and proc.poll() is None and time.monotonic() < deadline:
            pid = worker_pid(proc.pid, rank)
            if pid is None:
                time.sleep(0.05)  # polling for the worker to exist, with a deadline
        if pid is None:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        else:
            with Throttle(pid, stop_s, run_s):
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            for child in _descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            proc.kill()
            proc.wait()
