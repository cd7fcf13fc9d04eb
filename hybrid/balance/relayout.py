"""A worker's side of elastic re-layout (``launcher.min_nodes``): the launcher asks, in the
attempt's store, that the workers stop at their next checkpoint so that a node that came
back can be taken in (``launch.launchers.elastic``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hybrid.groups import ParallelGroups
from hybrid.planning.config import Config

RELAYOUT_KEY = "relayout"
"""The key an elastic launcher sets in the attempt's store to stop the workers at the next
checkpoint."""


def relayout_asked(cfg: Config, store: Optional[dist.Store], groups: ParallelGroups,
                   step: int) -> bool:
    """Whether the launcher asked to stop for a new layout: asked at each checkpoint step, so
    that the next attempt resumes from this step's checkpoint. Rank 0 reads the store; every
    rank follows its answer (one all-reduce, so all stop at the same step)."""
    every = cfg.checkpoint.every
    if cfg.launcher.min_nodes is None or every <= 0 or step % every or store is None:
        return False
    asked = float(dist.get_rank() == 0 and store.check([RELAYOUT_KEY]))
    flag = torch.tensor([asked], device=groups.device)
    groups.world.all_reduce(flag)
    return bool(flag.item())
