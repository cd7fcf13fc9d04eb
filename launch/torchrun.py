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
from typing import Any, Callable, Sequence

from launch.agent import run_agent
from launch.rendezvous import Rendezvous


class TorchrunLauncher:
    """Starts this node's ``launcher.nproc_per_node`` ranks and meets the other nodes."""

    runs_here = True
    """This machine runs the ranks: its memory and devices are the job's."""

    def check(self, cfg, layout) -> None:
        """What only a multi-node run needs, beyond ``validate_config``'s launcher checks."""
        from hybrid.planning.layout import LayoutError

        ckpt = cfg.checkpoint
        if cfg.launcher.nnodes > 1 and (ckpt.every or ckpt.resume_from) and ckpt.dir is None:
            raise LayoutError(
                f"launcher.nnodes={cfg.launcher.nnodes} with checkpoints: every node writes its "
                f"ranks' files, and each node's run directory differs; set checkpoint.dir to "
                f"one path that all nodes share")

    def rendezvous(self, cfg) -> Rendezvous:
        launcher = cfg.launcher
        if launcher.nnodes == 1 and launcher.rdzv_endpoint is None:
            return Rendezvous()
        return Rendezvous(nnodes=launcher.nnodes, node_rank=launcher.node_rank,
                          endpoint=launcher.rdzv_endpoint, timeout_s=launcher.rdzv_timeout_s)

    def launch(self, entrypoint: Callable[..., Any], args: Sequence[Any], cfg, layout,
               run_dir: Path, **options: Any) -> list[Any]:
        from hybrid.planning.validate import ranks_per_node

        nproc = ranks_per_node(cfg, layout)
        return run_agent(entrypoint, args, nproc=nproc, rendezvous=self.rendezvous(cfg),
                         run_dir=run_dir, **options)
