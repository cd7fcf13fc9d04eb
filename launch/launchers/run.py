"""Start a prepared run's workers through a launcher, and say in one line how they ended.

``launch.commands.train`` (``hybrid-train``) and ``launch.launchers.slurm_node`` (each node of a Slurm job) both
start workers through here; neither this module nor the launchers import ``launch.commands.train``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from hybrid.errors import UserError
from hybrid.planning.job import JobPlan
from hybrid.files import write_text
from hybrid.planning.config import to_dict
from hybrid.planning.plan_file import plan_to_dict, save_plan
from hybrid.diagnosis.stall import FAILURE_FILE
from launch.launchers.agent import AGENT_LOG, default_omp_threads
from launch.launchers.fork_server import MEGATRON_IMPORT_WARNING, WORKER_PRELOAD, start_fork_server
from launch.launchers.failures import count_restarts

WORKER_FAILED_EXIT = 1
WORKER_USER_ERROR = UserError.__name__
"""What a worker's bad input is raised as (``hybrid.worker``): reported as its one line."""
WORKER_DIAGNOSES = ("StallError",)
"""Failures whose one line already names the ranks involved (``hybrid.diagnosis.watch``)."""


def stall_diagnosis(run_dir: Path, since: float) -> Optional[str]:
    """The diagnosis line of a stall in this launch (``failure.json`` newer than ``since``).

    It wins over the agent's first failure: the rank that wrote it may have stopped a silent
    rank (``hybrid.diagnosis.watch.stop_silent_ranks``), whose death the agent can see first.
    """
    path = run_dir / FAILURE_FILE
    try:
        if path.stat().st_mtime < since:
            return None
        return f"{json.loads(path.read_text())['diagnosis']}; every rank's state: {path}"
    except (OSError, ValueError, KeyError):
        return None


def failure_line(err, run_dir: Path, since: float) -> str:
    """The line a worker's failure ends in: a stall is its diagnosis; a user error raised in a
    worker (a damaged checkpoint, a bad data window) is one line; anything else is a bug and
    keeps its traceback."""
    kind = err.error.split(":", 1)[0]
    diagnosis = stall_diagnosis(run_dir, since)
    if diagnosis is not None:
        return diagnosis
    if kind in WORKER_DIAGNOSES:
        return err.error.split(":", 1)[1].strip()
    if kind == WORKER_USER_ERROR:
        return f"rank {err.rank}: {err.error.split(':', 1)[1].strip()}"
    return str(err)


def save_run_files(plan: JobPlan, run_dir: Path) -> None:
    """``config.json`` (the config as composed; ``hybrid.planning.config.from_dict`` reloads it
    identically) and ``plan.json`` (the frozen plan every rank reads) into ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / "config.json", json.dumps(to_dict(plan.cfg), indent=1) + "\n")
    save_plan(plan, run_dir)


def start_workers_fork_server(plan: JobPlan, launcher) -> None:
    """Start the fork server that ``launch`` will fork this node's workers from, if they start
    here through one and it is not running yet. ``hybrid-train`` calls it as soon as the config
    has passed its checks, so that the server's imports of torch and megatron-core (the longest
    part of a launch) overlap the rest of its preparation (the data, the checkpoint) and its
    own import of torch; a config refused by those checks starts no process at all."""
    cfg = plan.cfg
    if cfg.launcher.start_method != "forkserver" or not launcher.runs_here:
        return
    # Read when the fork server's interpreter starts, before it imports megatron-core, which
    # warns that Transformer Engine and Apex are absent: expected on CPU, noise on a console.
    os.environ.setdefault("PYTHONWARNINGS", MEGATRON_IMPORT_WARNING)
    threads = cfg.launcher.omp_threads or default_omp_threads(plan.ranks_per_node)
    start_fork_server(WORKER_PRELOAD, threads)


def launch(plan: JobPlan, run_dir: Path, launcher, attempt: int = 0) -> Optional[list]:
    """Start the workers of ``plan`` through ``launcher``; their results by rank, or None
    when the launcher left them running (a Slurm job submitted without waiting, a dry run).
    Every worker gets the plan itself: none plans again. ``attempt``: which elastic attempt
    this is (``launch.launchers.elastic``: a new plan after nodes left; 0 otherwise)."""
    cfg = plan.cfg
    start_workers_fork_server(plan, launcher)  # before this process imports torch: overlap
    from hybrid.worker import worker_main

    again = {"attempt": attempt} if attempt else {}
    return launcher.launch(
        worker_main, (plan_to_dict(plan), str(run_dir), attempt), plan, run_dir,
        omp_threads=cfg.launcher.omp_threads, max_restarts=cfg.launcher.max_restarts,
        start_method=cfg.launcher.start_method, preload=WORKER_PRELOAD, **again)


def report_results(results: list, run_dir: Path) -> None:
    """The run's last lines: its loss over every step it trained, across restarts (from
    ``metrics.jsonl``, where every attempt's steps are), and where it lives."""
    from hybrid.metrics import read_metrics

    last = {}
    metrics = run_dir / "metrics.jsonl"
    for record in read_metrics(metrics) if metrics.is_file() else []:
        last[record["step"]] = record["loss"]  # a step run again after a restart: its last
    losses = [last[s] for s in sorted(last)] or results[0]["losses"]
    restarts = count_restarts(run_dir, AGENT_LOG)
    relayouts = len(list(run_dir.glob("attempt-*/plan.json")))  # launch.launchers.elastic
    again = ", ".join([f"{restarts} restart{'s' * (restarts > 1)}"] * bool(restarts)
                      + [f"{relayouts} re-layout{'s' * (relayouts > 1)}"] * bool(relayouts))
    again = f" ({again})" if again else ""
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps{again}")
    print(f"run directory: {run_dir}")
