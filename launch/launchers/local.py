"""``launcher=local``: every rank on this machine, one agent (``torchrun --standalone``).

``run_local(fn, args, nproc=4, run_dir=...)`` runs ``fn(*args)`` on 4 workers of this machine
and returns their results by rank (see ``launch.launchers.agent`` for failures and signals).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from launch.launchers.agent import default_omp_threads, run_agent
from launch.launchers.agent_worker import worker_env_summary
from launch.launchers.failures import LaunchInterrupted, WorkerFailure
from launch.launchers.launcher import register_launcher
from launch.launchers.rendezvous import Rendezvous

__all__ = ["LaunchInterrupted", "LocalLauncher", "WorkerFailure", "default_omp_threads",
           "run_local", "worker_env_summary"]


def run_local(entrypoint: Callable[..., Any], args: Sequence[Any], *, nproc: int,
              **options: Any) -> list[Any]:
    """``run_agent`` on one node (a c10d rendezvous on a free local port)."""
    return run_agent(entrypoint, args, nproc=nproc, rendezvous=Rendezvous(), **options)


@register_launcher
class LocalLauncher:
    """Starts the job's ``dp * tp * pp`` ranks on this machine."""

    name = "local"
    runs_here = True
    """This machine runs the ranks: its memory and devices are the job's."""

    def config_problem(self, cfg) -> Optional[str]:
        if cfg.launcher.nnodes != 1:
            return (f"launcher=local runs one node, not launcher.nnodes={cfg.launcher.nnodes}; "
                    f"use launcher=torchrun on each node")
        if cfg.launcher.min_nodes is not None:
            return (f"launcher.min_nodes={cfg.launcher.min_nodes} is for jobs of several nodes "
                    f"with launcher=torchrun; drop it (max_restarts restarts one node's "
                    f"workers)")
        return None

    def check_here(self, plan) -> None:
        pass

    def launch(self, entrypoint: Callable[..., Any], args: Sequence[Any], plan, run_dir: Path,
               **options: Any) -> list[Any]:
        return run_local(entrypoint, args, nproc=plan.world_size, run_dir=run_dir, **options)
