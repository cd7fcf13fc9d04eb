"""``ParallelGroups``: torch process groups for one ``Layout``, passed explicitly.

Nothing here is module-level state: build one object per layout and hand it to whatever needs
a group. Several layouts can live in one process (a reference model beside a parallel one), and
a layout smaller than the world is replicated: with 8 processes, ``Layout(tp=2)`` gives four
independent 2-rank replicas, and ``Layout()`` gives every process its own 1-rank model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from hybrid.planning.layout import Layout, LayoutError

GROUP_AXES = ("dp", "tp", "pp", "tp-pp", "embedding")


def default_device() -> torch.device:
    """CUDA (this process's local GPU) when available, else CPU."""
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class ParallelGroups:
    """The process groups of one layout, seen from the calling rank.

    ``ranks[axis]`` is the global rank list of this rank's group along ``axis`` and
    ``group[axis]`` the matching torch ``ProcessGroup``. Shorthands: ``dp``, ``tp``, ``pp``,
    ``mp`` (tp-pp, the model-parallel group) and ``embedding``.
    """

    layout: Layout
    global_rank: int
    replica_offset: int
    device: torch.device
    group: dict[str, dist.ProcessGroup] = field(repr=False)
    ranks: dict[str, list[int]]

    @classmethod
    def create(cls, layout: Layout, device: torch.device | None = None,
               timeout: timedelta | None = None) -> "ParallelGroups":
        """Build every group of ``layout``; a collective call that all ranks must make.

        ``timeout`` bounds every collective of these groups. Pass the job's: a group made by
        ``new_group`` does not inherit the default group's timeout but takes torch's default
        (30 minutes), so a stalled peer would hold a TP or DP collective that long.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group "
                               "(hybrid-train and hybrid.testing.spawn do this for you)")
        world, me = dist.get_world_size(), dist.get_rank()
        if world % layout.world_size:
            raise LayoutError(
                f"world size {world} is not a multiple of dp*tp*pp={layout.world_size} "
                f"({layout.describe()}); launch {layout.world_size} processes or change the layout"
            )
        device = device or default_device()
        backend = backend_for(device)
        replicas = world // layout.world_size
        mine_offset = me - me % layout.world_size
        groups, ranks = {}, {}
        for axis in GROUP_AXES:
            for replica in range(replicas):
                offset = replica * layout.world_size
                for local in layout.groups(axis):
                    members = [offset + r for r in local]
                    # new_group is collective over the world: every rank makes every group.
                    pg = dist.new_group(members, backend=backend, timeout=timeout)
                    if me in members:
                        groups[axis], ranks[axis] = pg, members
        return cls(layout=layout, global_rank=me, replica_offset=mine_offset, device=device,
                   group=groups, ranks=ranks)

    # ----- this rank's coordinates -----------------------------------------------------------
    @property
    def local_rank_in_layout(self) -> int:
        return self.global_rank - self.replica_offset

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.local_rank_in_layout)

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.last_stage_pp_rank

    def pp_neighbour(self, step: int) -> int:
        """Global rank of the stage ``step`` positions later in this pipeline (wrapping)."""
        members = self.ranks["pp"]
        return members[(self.pp_rank + step) % len(members)]

    # ----- shorthands ------------------------------------------------------------------------
    @property
    def dp(self) -> dist.ProcessGroup:
        return self.group["dp"]

    @property
    def tp(self) -> dist.ProcessGroup:
        return self.group["tp"]

    @property
    def pp(self) -> dist.ProcessGroup:
        return self.group["pp"]

    @property
    def mp(self) -> dist.ProcessGroup:
        return self.group["tp-pp"]

    @property
    def embedding(self) -> dist.ProcessGroup:
        return self.group["embedding"]

    def destroy(self) -> None:
        """Release this layout's groups (optional; the default group outlives them)."""
        for pg in {id(g): g for g in self.group.values()}.values():
            dist.destroy_process_group(pg)
        self.group.clear()
