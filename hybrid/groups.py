"""``ParallelGroups``: the process groups of one ``Layout``, by role, passed explicitly.

Nothing here is module-level state: build one object per layout and hand it to whatever needs
a group. Consumers ask for a role (``groups.gradient``, ``groups.tensor``, ...; the roles and
the axes they span are declared in ``hybrid.planning.layout.ROLES``), never for an axis; roles
over the same axes share one ``hybrid.comm.Group``. Several layouts can live in one process (a
reference model beside a parallel one), and a layout smaller than the world is replicated: with
8 processes, ``Layout(tp=2)`` gives four independent 2-rank replicas, and ``Layout()`` gives
every process its own 1-rank model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from hybrid.comm import Group
from hybrid.planning.layout import EMBEDDING, Layout, LayoutError, group_keys, role_key
from hybrid.transport import transport_of


def default_device() -> torch.device:
    """CUDA (this process's local GPU) when available, else CPU."""
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


@dataclass
class ParallelGroups:
    """The groups of one layout, seen from the calling rank: one ``Group`` per role.

    ``by_key[key]`` is this rank's group along ``key`` (``"dp"``, ``"tp"``, ``"pp"``,
    ``"tp-pp"``, ``"embedding"``: ``hybrid.planning.layout.role_key``); the role properties
    below are what consumers use. ``world`` is every process of the job.
    """

    layout: Layout
    global_rank: int
    replica_offset: int
    device: torch.device
    by_key: dict[str, Group] = field(repr=False)
    world: Group = field(repr=False)

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
                f"world size {world} is not a multiple of dp*cp*tp*pp={layout.world_size} "
                f"({layout.describe()}); launch {layout.world_size} processes or change the layout"
            )
        device = device or default_device()
        backend = transport_of(device).backend
        replicas = world // layout.world_size
        by_key, made = {}, {}
        for key in group_keys():
            for replica in range(replicas):
                offset = replica * layout.world_size
                for local in layout.groups(key):
                    members = [offset + r for r in local]
                    # new_group is collective over the world: every rank makes every group,
                    # in the same order. Keys with the same ranks (cp-dp and dp at cp=1) share
                    # one torch group and keep their own labels.
                    if tuple(members) not in made:
                        made[tuple(members)] = dist.new_group(members, backend=backend,
                                                              timeout=timeout)
                    if me in members:
                        by_key[key] = Group(made[tuple(members)], members, key, backend)
        return cls(layout=layout, global_rank=me, replica_offset=me - me % layout.world_size,
                   device=device, by_key=by_key, world=Group.world())

    def role(self, name: str) -> Group:
        """This rank's group of role ``name`` (``hybrid.planning.layout.ROLES``)."""
        return self.by_key[role_key(name)]

    def observe(self, observer) -> None:
        """Hand every operation on these groups to ``observer`` (a ``hybrid.comm.CommCounter``;
        None: stop)."""
        for group in (*self.by_key.values(), self.world):
            group.observer = observer

    # ----- the roles -------------------------------------------------------------------------
    @property
    def data(self) -> Group:
        """Ranks that read different samples: this rank reads share ``data.rank()``."""
        return self.role("data")

    @property
    def gradient(self) -> Group:
        """Ranks whose gradients are averaged once per step."""
        return self.role("gradient")

    @property
    def sharding(self) -> Group:
        """Ranks a ZeRO stage shards optimizer state (and gradients) over."""
        return self.role("sharding")

    @property
    def loss(self) -> Group:
        """Ranks whose last-stage losses are averaged into the step's loss."""
        return self.role("loss")

    @property
    def context(self) -> Group:
        """Ranks that split each sequence (context parallelism's ring, in zigzag order)."""
        return self.role("context")

    @property
    def tensor(self) -> Group:
        """Ranks that split each weight matrix."""
        return self.role("tensor")

    @property
    def pipeline(self) -> Group:
        """The stages of this rank's pipeline, in stage order."""
        return self.role("pipeline")

    @property
    def model(self) -> Group:
        """Ranks that hold one copy of every parameter between them (global norms)."""
        return self.role("model")

    @property
    def expert(self) -> Group:
        """Ranks that hold different experts of each MoE layer and exchange their tokens (the
        all-to-all; one rank at ``ep=1``)."""
        return self.role("expert")

    @property
    def embedding(self) -> Group:
        """This pipeline's first and last stage (a tied embedding's two copies)."""
        return self.by_key[EMBEDDING]

    # ----- this rank's coordinates -----------------------------------------------------------
    @property
    def local_rank_in_layout(self) -> int:
        return self.global_rank - self.replica_offset

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.local_rank_in_layout)

    @property
    def tp_rank(self) -> int:
        """Which slice of each weight matrix this rank holds."""
        return self.tensor.rank()

    @property
    def pp_rank(self) -> int:
        """Which pipeline rank this is (the stages it holds: ``stage_rank``)."""
        return self.pipeline.rank()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.last_stage_pp_rank

    def pp_neighbour(self, step: int) -> int:
        """Global rank of the stage ``step`` positions later in this pipeline (wrapping)."""
        members = self.pipeline.ranks
        return members[(self.pp_rank + step) % len(members)]

    def destroy(self) -> None:
        """Release this layout's groups (optional; the default group outlives them)."""
        for pg in {id(g.pg): g.pg for g in self.by_key.values()}.values():
            dist.destroy_process_group(pg)
        self.by_key.clear()
