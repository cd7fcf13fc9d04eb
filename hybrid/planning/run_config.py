"""The schema of where a run runs and what it keeps: ``launcher.*`` and ``checkpoint.*``
(keyword-only dataclasses, fields of ``hybrid.planning.config.Config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass(kw_only=True)
class LauncherConfig:
    name: str = "local"
    """local (torch elastic agent on this machine) | torchrun (one hybrid-train per node, each
    node's agent meeting the others at rdzv_endpoint) | slurm (one Slurm job, submitted
    through submitit, one task per node, each running its node's agent)."""
    nnodes: int = 1
    """Number of nodes."""
    nproc_per_node: Optional[int] = None
    """Processes per node; None means world size / nnodes."""
    node_rank: int = 0
    """This node's place among the nodes (torchrun): node i runs global ranks
    i * nproc_per_node to (i + 1) * nproc_per_node - 1; node 0 hosts the rendezvous."""
    rdzv_endpoint: Optional[str] = None
    """HOST:PORT where node 0 hosts the rendezvous (torchrun; required when nnodes > 1)."""
    rdzv_timeout_s: float = 300.0
    """Seconds a node waits for the others to arrive at the rendezvous."""
    omp_threads: Optional[int] = None
    """OMP_NUM_THREADS per worker; None means cores / local workers (at least 1)."""
    max_restarts: int = 0
    """Restarts of the whole worker group after a failure."""
    min_nodes: Optional[int] = None
    """torchrun, slurm: when nodes leave (killed, exited, silent), go on with as few as this
    many on a layout the survivors hold, the same global batch, from the newest checkpoint
    (needs checkpoint.every; docs/multinode.md); None: a node that leaves ends the job."""
    silence_timeout_s: float = 30.0
    """With min_nodes: a node not heard from for this long is counted as gone."""
    start_method: str = "forkserver"
    """How local workers start: forkserver (torch is imported once and shared: fast start) |
    spawn (each worker a fresh interpreter)."""
    partition: Optional[str] = None
    """Slurm partition (sbatch --partition); None means the cluster's default."""
    time_min: int = 60
    """Slurm time limit of the job in minutes (sbatch --time)."""
    account: Optional[str] = None
    """Slurm account to charge (sbatch --account)."""
    qos: Optional[str] = None
    """Slurm quality of service (sbatch --qos)."""
    constraint: Optional[str] = None
    """Slurm node features required (sbatch --constraint)."""
    cpus_per_task: Optional[int] = None
    """CPUs of each node's task (it runs the node's ranks); None means one per rank."""
    gpus_per_node: Optional[int] = None
    """GPUs per node; None means one per rank when train.device=cuda, none otherwise."""
    mem_gb: Optional[int] = None
    """Memory per node in GiB (sbatch --mem); None means the cluster's default."""
    sbatch: Dict[str, str] = field(default_factory=dict)
    """Any other sbatch option, e.g. launcher.sbatch={exclusive:'',reservation:r1}."""
    setup: List[str] = field(default_factory=list)
    """Shell lines the job script runs before starting the nodes (module load, ...)."""
    job_name: str = "hybrid"
    """Slurm job name."""
    wait: bool = True
    """Slurm: wait for the job, show rank 0's progress and exit with its status; false
    prints the job id and run directory and returns (a sweep's cells are waited at its end)."""
    dry_run: bool = False
    """Slurm: print the sbatch script, the per-node command and the rank table, submit
    nothing (the resolved config.json is written, ready for a job started by hand)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 0
    """Save after every N-th optimizer step (0 = never)."""
    keep: int = 3
    """Keep the newest K complete checkpoints, delete older ones (0 = keep all)."""
    dir: Optional[str] = None
    """Where checkpoints go, one directory per checkpoint (``step_00000005``); None means
    ``<run dir>/checkpoints``."""
    resume_from: Optional[str] = None
    """A checkpoint directory, a run directory (its newest complete checkpoint), or ``auto``
    (the newest complete one in ``checkpoint.dir``; none there means start fresh)."""
    init_from: Optional[str] = None
    """Start from these model weights (a checkpoint or run directory of any layout, or what
    ``hybrid-ckpt import`` made of an HF GPT-2) at step 0 with a fresh optimizer: fine-tuning.
    Not with resume_from, which continues a run."""
    async_save: bool = False
    """Write checkpoints in the background (DCP's async save): training goes on while a
    host-memory copy of the state is written."""
