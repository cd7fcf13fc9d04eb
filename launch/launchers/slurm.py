"""``launcher=slurm``: one Slurm job through submitit, one task per node.

    hybrid-train launcher=slurm launcher.nnodes=4 launcher.nproc_per_node=8 \\
        launcher.partition=gpu launcher.time_min=120

runs every check on the login node, writes the resolved config into the run directory (which
must be on a filesystem the nodes share, as submitit's own files are), then submits a job of
``launcher.nnodes`` tasks. Each task is one node: ``launch.launchers.slurm_node.run_node`` runs the
node's torch elastic agent; the job script picks a free port on the first node, where the
agents meet (torch's static rendezvous). By default ``hybrid-train`` waits, shows rank 0's
progress and exits with the job's status (``slurm_job.py``; Ctrl-C cancels the job);
``launcher.wait=false`` prints the job id and the run directory and returns;
``launcher.dry_run=true`` prints the job script, the per-node command and the rank table, and
submits nothing.

In a Hydra multirun (``hybrid-train -m ... launcher=slurm``) every cell is submitted without
waiting, so the cells run side by side as separate jobs; ``launch.reports.sweep`` waits for them all
at the end of the sweep and reports each.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from hybrid.planning.elastic import elastic_problem
from launch.launchers.failures import LaunchFailed
from launch.launchers.slurm_job import node_results, wait_for
from launch.launchers.slurm_partition import partition_nodes, partition_problem
from launch.launchers.launcher import register_launcher
from launch.launchers.slurm_node import RDZV_PORT_ENV

SLURM_DIR = "slurm"
"""submitit's folder in the run directory: job scripts, pickles, each task's log."""
SWEEP_JOBS = "slurm_jobs.jsonl"
"""In a multirun's sweep directory: one line per submitted cell (``launch.reports.sweep``)."""


def sbatch_parameters(plan) -> dict[str, Any]:
    """The job's sbatch options, in submitit's names."""
    cfg = plan.cfg
    launcher, nproc = cfg.launcher, plan.ranks_per_node
    elastic = launcher.min_nodes is not None
    # launcher.min_nodes: a node that fails must end neither the job nor its step; the nodes
    # left go on without it (launch.launchers.elastic).
    sbatch = {**({"no_kill": True} if elastic else {}), **launcher.sbatch}
    gpus = launcher.gpus_per_node
    if gpus is None and cfg.train.device == "cuda":
        gpus = nproc
    chosen = {
        "job_name": launcher.job_name, "nodes": launcher.nnodes, "ntasks_per_node": 1,
        "cpus_per_task": launcher.cpus_per_task or nproc, "time": launcher.time_min,
        "partition": launcher.partition, "account": launcher.account, "qos": launcher.qos,
        "constraint": launcher.constraint, "gpus_per_node": gpus or None,
        "mem": None if launcher.mem_gb is None else f"{launcher.mem_gb}GB",
        "additional_parameters": sbatch or None,
        # The first node's free port, exported to every task by srun.
        "setup": [*launcher.setup, f"export {RDZV_PORT_ENV}=$({shlex.quote(sys.executable)} "
                                   f"-m launch.launchers.slurm_node --free-port)"],
        # Else one node that fails ends the job at once, not after the others' timeouts.
        "srun_args": ["--no-kill"] if elastic else ["--kill-on-bad-exit=1"],
    }
    return {key: value for key, value in chosen.items() if value is not None}


def node_command(run_dir: Path) -> str:
    """What each task runs, as a command line (submitit runs the same function)."""
    return f"{shlex.quote(sys.executable)} -m launch.launchers.slurm_node {shlex.quote(str(run_dir))}"


def dry_run_text(plan, run_dir: Path) -> str:
    """The job script submitit would submit, the per-node command and the rank table."""
    cfg, layout = plan.cfg, plan.layout
    from submitit.slurm.slurm import _make_sbatch_string  # the text SlurmExecutor submits

    folder = run_dir / SLURM_DIR
    submit = f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(str(folder))}"
    script = _make_sbatch_string(command=submit, folder=folder, **sbatch_parameters(plan))
    nproc = plan.ranks_per_node
    rows = [f"{r:>4}  {layout.node_of(r, nproc):>4}  {c['dp']:>2}  "
            + (f"{c['cp']:>2}  " if layout.cp > 1 else "") + f"{c['tp']:>2}  {c['pp']:>2}"
            for r in range(layout.world_size) for c in [layout.coords(r)]]
    return "\n".join([
        f"# dry run: launcher.nnodes={cfg.launcher.nnodes} nodes x 1 task, "
        f"{nproc} ranks per node; nothing was submitted", "",
        "# job script (sbatch):", script.rstrip(), "",
        "# per-node command (one task per node; submitit runs it as "
        "launch.launchers.slurm_node.run_node):", node_command(run_dir), "",
        "# ranks:", "rank  node  dp  " + "cp  " * (layout.cp > 1) + "tp  pp", *rows, "",
        f"# run directory (config.json and plan.json written): {run_dir}",
    ])


@register_launcher
class SlurmLauncher:
    """Submits the job from this (login) machine; the ranks run on the job's nodes."""

    name = "slurm"
    runs_here = False
    """This machine's memory and devices are not the job's."""

    def config_problem(self, cfg) -> Optional[str]:
        launcher = cfg.launcher
        if launcher.rdzv_endpoint is not None or launcher.node_rank != 0:
            return ("launcher=slurm places the nodes itself (the job's first node hosts the "
                    "rendezvous); drop launcher.rdzv_endpoint and launcher.node_rank")
        return elastic_problem(cfg)

    def check_here(self, plan) -> None:
        from hybrid.planning.layout import LayoutError

        if plan.cfg.launcher.dry_run:
            return
        if shutil.which("sbatch") is None:
            raise LayoutError("launcher=slurm needs Slurm's sbatch, not found on PATH: run "
                              "hybrid-train on the cluster's login node, or see the job with "
                              "launcher.dry_run=true")
        problem = partition_problem(sbatch_parameters(plan), partition_nodes(
            plan.cfg.launcher.partition))
        if problem:
            raise LayoutError(problem)

    def launch(self, entrypoint, args, plan, run_dir: Path,
               **options: Any) -> Optional[list]:
        """Submit (the nodes start ``hybrid.worker.worker_main`` themselves, from the run
        directory's plan.json: ``entrypoint``, ``args`` and ``options`` are theirs too)."""
        run_dir = Path(run_dir)
        cfg = plan.cfg
        if cfg.launcher.dry_run:
            print(dry_run_text(plan, run_dir))
            return None
        job = submit(plan, run_dir)
        sweep_dir = multirun_sweep_dir()
        print(f"submitted slurm job {job.job_id}: {cfg.launcher.nnodes} node(s) x "
              f"{plan.ranks_per_node} ranks; run directory: {run_dir}", flush=True)
        if sweep_dir is not None and cfg.launcher.wait:
            record_sweep_cell(sweep_dir, job, run_dir)
            return None
        if not cfg.launcher.wait:
            print(f"rank 0's output: {job.task(0).paths.stdout}")
            return None
        elastic = cfg.launcher.min_nodes is not None
        try:
            outcomes = wait_for(job, follow=True, node0_speaks=elastic)
        except KeyboardInterrupt:
            job.cancel(check=False)
            raise KeyboardInterrupt(f"cancelled slurm job {job.job_id}") from None
        if elastic and outcomes[0] is not None and "results" in outcomes[0]:
            return outcomes[0]["results"]  # it went on without the nodes that left
        return node_results(outcomes, job)


def submit(plan, run_dir: Path):
    import submitit

    from launch.launchers.slurm_node import run_node

    executor = submitit.SlurmExecutor(folder=run_dir / SLURM_DIR, python=sys.executable)
    executor.update_parameters(**sbatch_parameters(plan))
    try:
        return executor.submit(run_node, str(run_dir))
    except subprocess.CalledProcessError as err:
        detail = (err.stderr or err.output or b"").decode(errors="replace").strip()
        raise LaunchFailed(f"sbatch refused the job: {detail.splitlines()[-1] if detail else err}"
                           f"; check launcher.partition, launcher.time_min and the other "
                           f"launcher options against sinfo") from None


def multirun_sweep_dir() -> Optional[Path]:
    """The sweep directory when this is a cell of a Hydra multirun, else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().sweep.dir)


def record_sweep_cell(sweep_dir: Path, job, run_dir: Path) -> None:
    from hydra.core.hydra_config import HydraConfig

    line = {"job_id": str(job.job_id), "folder": str(run_dir / SLURM_DIR),
            "run_dir": str(run_dir), "nodes": job.num_tasks,
            "overrides": list(HydraConfig.get().overrides.task)}
    with open(sweep_dir / SWEEP_JOBS, "a") as handle:
        handle.write(json.dumps(line) + "\n")
