"""One node of a Slurm job: run this node's torch elastic agent on a run directory.

``launcher=slurm`` submits a job with one task per node; each task calls ``run_node(RUN_DIR)``
(through submitit). A cluster that forbids submitit can start the same thing from its own
job script, one task per node (docs/multinode.md has the template)::

    export HYBRID_RDZV_PORT=$(python -m launch.launchers.slurm_node --free-port)   # on the first node
    srun --ntasks-per-node=1 python -m launch.launchers.slurm_node RUN_DIR

Slurm says where each task stands: ``SLURM_NODEID`` is the node's rank, and the job's first
node (node 0, where the batch script and ``srun`` run: ``SLURM_LAUNCH_NODE_IPADDR``) hosts the
rendezvous on the free port the script chose there (``HYBRID_RDZV_PORT``). Node ``i`` runs
global ranks ``i * nproc_per_node`` onwards, as with ``launcher=torchrun``; each node's agent
log and workers' logs go to ``RUN_DIR/nodes/node<i>``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from launch.launchers.agent import run_agent
from launch.launchers.failures import LaunchFailed, LaunchInterrupted, WorkerFailure
from launch.launchers.rendezvous import Rendezvous

RDZV_PORT_ENV = "HYBRID_RDZV_PORT"
SLURM_VARIABLES = ("SLURM_NODEID", "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_TASKS",
                   "SLURM_LAUNCH_NODE_IPADDR", RDZV_PORT_ENV)
USAGE = ("usage: python -m launch.launchers.slurm_node RUN_DIR (one Slurm task per node) | "
         "python -m launch.launchers.slurm_node --free-port")


def slurm_rendezvous(cfg, env: Mapping[str, str]) -> Rendezvous:
    """Where this task's agent meets the others', from the Slurm step's variables; a job
    shaped unlike the config is refused in one line."""
    missing = [name for name in SLURM_VARIABLES if name not in env]
    if missing:
        raise LaunchFailed(f"{', '.join(missing)} not set: run one task per node inside a "
                           f"Slurm job, with {RDZV_PORT_ENV} exported by the job script "
                           f"({USAGE})")
    nodes, tasks = int(env["SLURM_JOB_NUM_NODES"]), int(env["SLURM_STEP_NUM_TASKS"])
    if nodes != cfg.launcher.nnodes or tasks != nodes:
        raise LaunchFailed(
            f"the Slurm step has {tasks} task(s) on {nodes} node(s) but the run's config has "
            f"launcher.nnodes={cfg.launcher.nnodes}; start one task per node "
            f"(sbatch --nodes={cfg.launcher.nnodes} --ntasks-per-node=1)")
    return Rendezvous(nnodes=nodes, node_rank=int(env["SLURM_NODEID"]),
                      endpoint=f"{env['SLURM_LAUNCH_NODE_IPADDR']}:{env[RDZV_PORT_ENV]}",
                      timeout_s=cfg.launcher.rdzv_timeout_s)


class SlurmNodeLauncher:
    """This node's part of a Slurm job (``launch.launchers.run.launch`` with this launcher; not
    registered: ``launcher=slurm`` names ``SlurmLauncher``, which submits the job)."""

    name = "slurm-node"
    runs_here = True

    def __init__(self, meeting: Rendezvous):
        self.meeting = meeting
        """Where the job's nodes meet, from Slurm's variables (attempt 0)."""

    def config_problem(self, cfg) -> Optional[str]:
        return None

    def check_here(self, plan) -> None:
        pass

    def rendezvous(self, cfg, attempt: int = 0) -> Rendezvous:
        """``attempt`` > 0: an elastic job's later attempt (``launch.launchers.elastic``), met
        at the same endpoint under its own run id, with the nodes and node rank of its plan."""
        if not attempt:
            return self.meeting
        return Rendezvous(nnodes=cfg.launcher.nnodes, node_rank=cfg.launcher.node_rank,
                          endpoint=self.meeting.endpoint, timeout_s=self.meeting.timeout_s,
                          run_id=f"hybrid-{attempt}")

    def launch(self, entrypoint: Callable[..., Any], args: Sequence[Any], plan, run_dir: Path,
               attempt: int = 0, **options: Any) -> list[Any]:
        logs = Path(run_dir) / "nodes" / f"node{self.meeting.node_rank}"  # Slurm's node id
        return run_agent(entrypoint, args, nproc=plan.ranks_per_node,
                         rendezvous=self.rendezvous(plan.cfg, attempt), run_dir=logs, **options)


def run_node(run_dir: str) -> dict:
    """Run this node's ranks of the run in ``run_dir``; what happened, as a dict that the
    submitting ``hybrid-train`` reads back: ``{"node": i, "results": [...]}`` (this node's
    ranks' summaries) or ``{"node": i, "error": "<one line>"}``."""
    from hybrid.planning.plan_file import load_plan
    from launch.launchers.run import failure_line, launch

    path = Path(run_dir)
    plan = load_plan(path)  # made on the login node before submitting: never planned here
    node = int(os.environ.get("SLURM_NODEID", "0"))
    started = time.time()
    try:
        launcher = SlurmNodeLauncher(slurm_rendezvous(plan.cfg, os.environ))
        if plan.cfg.launcher.min_nodes is not None:  # go on with the nodes left
            from launch.launchers.elastic import run_elastic

            return {"node": node, "results": run_elastic(plan, path, launcher)}
        return {"node": node, "results": launch(plan, path, launcher)}
    except WorkerFailure as err:
        return {"node": node, "error": failure_line(err, path, started)}
    except (LaunchFailed, LaunchInterrupted) as err:  # interrupted: scancel, time limit
        return {"node": node, "error": str(err)}


def free_port() -> int:
    """A port free on this machine now (the rendezvous binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--free-port"]:
        print(free_port())
        return
    if len(args) != 1 or args[0].startswith("-"):
        sys.exit(f"error: {USAGE}")
    if not (Path(args[0]) / "plan.json").is_file():
        sys.exit(f"error: {args[0]} holds no plan.json; pass a run directory written by "
                 f"hybrid-train (launcher.dry_run=true writes one without submitting)")
    outcome = run_node(args[0])
    if "error" in outcome:
        sys.exit(f"error: node {outcome['node']}: {outcome['error']}")
    if outcome["node"] == 0:
        from launch.launchers.run import report_results

        report_results(outcome["results"], Path(args[0]))


if __name__ == "__main__":
    main()
