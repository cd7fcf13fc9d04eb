"""A submitted Slurm job watched until it ends: its state from ``squeue``, rank 0's output
followed on the console, each node's outcome read back, and the one line that says why a job
did not train.

Apart from ``slurm.py`` (what is submitted and how) because ``launch.reports.sweep`` waits
for a multirun's jobs with the same code long after they were submitted.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from launch.launchers.failures import LaunchFailed
from launch.launchers.slurm_partition import NEVER_CLEARS

POLL_S = 0.5
END_WAIT_S = 60.0
"""How long the job may take to end once every task has written its result."""
ENDED = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
         "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT", "GONE")
"""Job states after which no task writes its result any more (``GONE``: squeue no longer
lists the job)."""
STOPPED_BY_SLURM = ("BOOT_FAIL", "CANCELLED", "DEADLINE", "NODE_FAIL", "OUT_OF_MEMORY",
                    "PREEMPTED", "TIMEOUT")


def job_state(job_id: str) -> str:
    """Slurm's state of the job (``squeue``, which needs no accounting database)."""
    return job_state_and_reason(job_id)[0]


def job_state_and_reason(job_id: str) -> tuple[str, str]:
    """Slurm's state of the job and its reason (why it pends: ``Resources``, ...)."""
    done = subprocess.run(["squeue", "--noheader", "--states=all", "--format=%T %r",
                           f"--jobs={job_id}"], capture_output=True, text=True, timeout=60)
    fields = done.stdout.strip().split(maxsplit=1)
    if done.returncode != 0 or not fields:
        return "GONE", ""
    return fields[0], fields[1] if len(fields) > 1 else ""


def wait_for(job, follow: bool = False, node0_speaks: bool = False) -> list:
    """Every task's outcome, once the job has ended; rank 0's output (and node 0's elastic
    lines) echoed meanwhile when ``follow``. A task that left no outcome is ``None``.
    ``node0_speaks`` (``launcher.min_nodes``): node 0's outcome is the job's, the others'
    are not waited for (a lost node's never comes)."""
    tasks = [job.task(i) for i in range(job.num_tasks)]
    followers = [LogFollower(tasks[0].paths.stdout),
                 LogFollower(tasks[0].paths.stderr, elastic_line, sys.stderr)] if follow else []
    checked, state = 0.0, "PENDING"
    awaited = tasks[:1] if node0_speaks else tasks
    while not all(task.paths.result_pickle.exists() for task in awaited):
        for follower in followers:
            follower.echo()
        if time.monotonic() - checked > 2:
            checked = time.monotonic()
            state, reason = job_state_and_reason(str(job.job_id))
            if state in ENDED:
                break
            if state == "PENDING" and reason in NEVER_CLEARS:
                job.cancel(check=False)
                raise LaunchFailed(f"slurm job {job.job_id} cannot start: Slurm keeps it "
                                   f"pending for {reason} ({NEVER_CLEARS[reason]}); cancelled "
                                   f"it: change the launcher options and submit again")
        time.sleep(POLL_S)
    for follower in followers:
        follower.echo()
    # The tasks write their results just before they exit: the job ends a moment later.
    deadline = time.monotonic() + END_WAIT_S
    while state not in ENDED and time.monotonic() < deadline:
        time.sleep(POLL_S)
        state = job_state(str(job.job_id))
    return [outcome_of(task) if task.paths.result_pickle.exists() else None for task in tasks]


def outcome_of(task) -> dict:
    """``run_node``'s dict; an exception it raised (a bug) becomes its last line."""
    try:
        return task.result()
    except Exception as err:  # submitit's FailedJobError carries the task's traceback
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        return {"node": task.task_id, "error": lines[-1] if lines else repr(err)}


def node_results(outcomes: list, job) -> list:
    """Node 0's ranks' results, or ``LaunchFailed`` with the first failure's line."""
    failure = job_failure(outcomes, job)
    if failure is not None:
        raise LaunchFailed(failure)
    return outcomes[0]["results"]


def job_failure(outcomes: list, job) -> Optional[str]:
    """One line saying why the job did not train, or None when every node finished: the
    job's state when Slurm ended it (cancelled, out of time, a node lost), else the first
    node's error."""
    errors = [o for o in outcomes if o is not None and "error" in o]
    missing = [i for i, o in enumerate(outcomes) if o is None]
    if not errors and not missing:
        return None
    state = job_state(str(job.job_id))
    log = job.task(missing[0] if missing else errors[0]["node"]).paths.stderr
    if state in STOPPED_BY_SLURM:
        return f"slurm job {job.job_id} ended {state} before it finished; see {log}"
    if errors:
        first = min(errors, key=lambda o: o["node"])
        return f"slurm job {job.job_id}, node {first['node']}: {first['error']}"
    return (f"slurm job {job.job_id} ended {state} before node(s) {missing} finished; "
            f"see {log}")


def elastic_line(line: str) -> bool:
    """Node 0's standard error lines shown on the console: who left, the new layout."""
    return line.startswith(("elastic: ", "warning: node "))


class LogFollower:
    """Echo the lines a growing log file gains that ``keep`` keeps (by default all but
    submitit's own) to ``stream`` (by default standard output)."""

    def __init__(self, path: Path, keep=lambda line: not line.startswith("submitit "),
                 stream=None):
        self.path, self.offset, self.keep, self.stream = path, 0, keep, stream

    def echo(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if self.keep(line):
                print(line, file=self.stream or sys.stdout, flush=True)
