"""``launcher=torchrun``: one ``hybrid-train`` per node, each running its node's agent, as
``torchrun`` does. Run the same command on every node, changing only the node's rank::

    hybrid-train launcher=torchrun launcher.nnodes=2 launcher.node_rank=0 \\
        launcher.nproc_per_node=4 launcher.rdzv_endpoint=node0.example:29500   # on node 0
    hybrid-train launcher=torchrun launcher.nnodes=2 launcher.node_rank=1 \\
        launcher.nproc_per_node=4 launcher.rdzv_endpoint=node0.example:29500   # on node 1

Node ``i`` runs global ranks ``i * nproc_per_node`` to ``(i + 1) * nproc_per_node - 1`` (torch's
static rendezvous at the endpoint, hosted by node 0), so node 0 holds rank 0, which writes the
metrics, the timeline and the checkpoint manifests into node 0's run directory; every node
keeps its own workers' logs in its own run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from hybrid.planning.elastic import elastic_problem
from launch.launchers.agent import run_agent
from launch.launchers.launcher import register_launcher
from launch.launchers.rendezvous import Rendezvous


@register_launcher
class TorchrunLauncher:
    """Starts this node's ``launcher.nproc_per_node`` ranks and meets the other nodes."""

    name = "torchrun"
    runs_here = True
    """This machine runs the ranks: its memory and devices are the job's."""

    def config_problem(self, cfg) -> Optional[str]:
        """What only a multi-node run needs, beyond ``validate_config``'s node checks."""
        launcher, ckpt = cfg.launcher, cfg.checkpoint
        if launcher.nnodes > 1 and launcher.rdzv_endpoint is None:
            return (f"launcher.nnodes={launcher.nnodes} needs launcher.rdzv_endpoint=HOST:PORT: "
                    f"node 0's address and a free port, the same on every node")
        if launcher.nnodes > 1 and (ckpt.every or ckpt.resume_from) and ckpt.dir is None:
            return (f"launcher.nnodes={launcher.nnodes} with checkpoints: every node writes its "
                    f"ranks' files, and each node's run directory differs; set checkpoint.dir "
                    f"to one path that all nodes share")
        return elastic_problem(cfg)

    def check_here(self, plan) -> None:
        pass

    def rendezvous(self, cfg, attempt: int = 0) -> Rendezvous:
        """``attempt`` > 0: an elastic job's later attempt, met under its own run id at the
        same endpoint (``launch.launchers.elastic``)."""
        launcher = cfg.launcher
        if launcher.nnodes == 1 and launcher.rdzv_endpoint is None:
            return Rendezvous()
        return Rendezvous(nnodes=launcher.nnodes, node_rank=launcher.node_rank,
                          endpoint=launcher.rdzv_endpoint, timeout_s=launcher.rdzv_timeout_s,
                          run_id=f"hybrid-{attempt}" if attempt else "hybrid")

    def launch(self, entrypoint: Callable[..., Any], args: Sequence[Any], plan, run_dir: Path,
               attempt: int = 0, **options: Any) -> list[Any]:
        return run_agent(entrypoint, args, nproc=plan.ranks_per_node,
                         rendezvous=self.rendezvous(plan.cfg, attempt), run_dir=run_dir,
                         **options)
