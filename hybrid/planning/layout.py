"""The rank layout of a job: named axes in one declared order, and the roles built on them
(pure: no torch).

A layout is a grid of ``dp * cp * tp * pp`` ranks. The axes are declared once, in ``AXES``
(``hybrid.planning.axes``, with the roles); the ``order`` string names them from the
fastest-varying to the slowest, exactly as megatron-core's ``RankGenerator`` reads it
(``"tp-cp-ep-dp-pp"`` there, without ``ep`` here): with the default ``"tp-cp-dp-pp"`` the
ranks of one TP group are consecutive (so they sit inside one node), then those of one
context-parallel group. As there, an order may leave out ``cp`` while it is 1
(``"tp-dp-pp"``, every layout before context parallelism). Every group of every axis is a
slice of this one grid, so all groups agree.

Nothing outside this module asks for "the dp group". Consumers ask for a *role* (``ROLES``):
which ranks split the data, average gradients, make the step's loss, shard optimizer state,
split weight matrices, form a pipeline, hold one copy of the model. Each role is a set of
axes; ``ParallelGroups`` (``hybrid.groups``) makes one process group per distinct set, so
roles over the same axes share one group. Context parallelism (``cp``: each rank of a context
group holds two of the ``2 * cp`` chunks of every sequence) joins the gradient, loss and
sharding roles as megatron's ``dp_cp`` does, and has a role of its own for attention's ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid.errors import UserError
from hybrid.planning.axes import (AXES, AXIS_TRAFFIC, COORD_ORDER, DEFAULT_ORDER, EMBEDDING,
                                  EXPERT_AXES, ROLES, on_expert_grid)
from hybrid.planning.grid import expert_order, grid_groups
from hybrid.planning.schedules.stage_map import STAGE_RULES, stage_rank


def role_key(role: str) -> str:
    """The group a role runs on, as ``Layout.groups`` names it: its axes in ``AXES`` order
    (``"tp-pp"`` for the model role), or ``"embedding"``; also the label its traffic is
    counted under."""
    if role == EMBEDDING:
        return EMBEDDING
    if role not in ROLES:
        raise LayoutError(f"unknown role {role!r}; roles are {', '.join(ROLES)}, {EMBEDDING}")
    axes = ROLES[role].axes
    return "-".join(axis for axis in (EXPERT_AXES if on_expert_grid(axes) else AXES)
                    if axis in axes)


def group_keys() -> list[str]:
    """The distinct groups the roles need, in a fixed order (every rank makes them alike)."""
    keys = [role_key(role) for role in ROLES] + [EMBEDDING]
    return list(dict.fromkeys(keys))


class LayoutError(UserError):
    """A user error in the parallel layout or the config that it must fit; one line with the
    fix."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_order(order: str, cp: int = 1) -> tuple[str, ...]:
    """``"tp-cp-dp-pp"`` -> ``("tp", "cp", "dp", "pp")``: each axis exactly once. As in
    megatron-core, an order may leave out ``cp`` while ``cp == 1`` (it then varies slowest)."""
    names = tuple(order.lower().split("-"))
    if "cp" not in names and cp == 1:
        names = names + ("cp",)
    if sorted(names) != sorted(AXES):
        raise LayoutError(
            f"parallel.order={order!r} is not a permutation of {'-'.join(AXES)}"
            f"{' (cp > 1 must be placed)' if 'cp' not in names else ''}; use e.g. "
            f"order=tp-cp-dp-pp (Megatron's default, TP fastest) or order=tp-cp-pp-dp"
        )
    return names


@dataclass(frozen=True)
class Layout:
    """The rank grid of one job: sizes of each axis and the order in which ranks fill it."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    order: str = DEFAULT_ORDER
    vpp: int = 1
    stage_placement: str = "loop"
    """The name of the stage map: which pipeline rank holds each virtual stage
    (``hybrid.planning.schedules.stage_map``: "loop", "v" for zb-v and dualpipev, or a rule a
    schedule module registers; ``placement_warnings`` is about nodes, not this).
    It decides where the first and last stage, and so the tied embedding, live."""
    ep: int = 1
    """Expert parallelism: ranks carved out of ``dp * cp`` that hold different experts
    (``EXPERT_AXES``; not an axis of the dense grid: the world size does not change)."""
    _axes: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in (*AXES, "vpp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name}={value!r} must be an integer >= 1")
        if self.stage_placement not in STAGE_RULES:
            raise LayoutError(f"stage_placement={self.stage_placement!r} is not one of "
                              f"{tuple(STAGE_RULES)}")
        object.__setattr__(self, "_axes", parse_order(self.order, self.cp))
        width = self.dp * self.cp
        if width % self.ep:
            fits = ", ".join(map(str, _divisors(width)))
            raise LayoutError(f"parallel.ep={self.ep} does not divide dp*cp={width} (the ranks "
                              f"experts are spread over); choose ep in {{{fits}}}")

    # ----- sizes and coordinates -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        size = 1
        for axis in AXES:
            size *= self.size(axis)
        return size

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes from fastest- to slowest-varying."""
        return self._axes

    def size(self, axis: str) -> int:
        if axis not in AXES:
            raise LayoutError(f"unknown axis {axis!r}; the axes are {', '.join(AXES)}")
        return getattr(self, axis)

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for axis in self._axes:
            strides[axis] = stride
            stride *= self.size(axis)
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> its coordinate on every axis, ``{"dp": i, "cp": c, "tp": j, "pp": k}``."""
        self._check_rank(rank)
        strides = self._strides()
        return {axis: (rank // strides[axis]) % self.size(axis) for axis in COORD_ORDER}

    def rank(self, **coords: int) -> int:
        """Coordinates (``dp=i, tp=j, pp=k``; an axis left out is 0) -> global rank."""
        unknown = sorted(set(coords) - set(AXES))
        if unknown:
            raise LayoutError(f"unknown axis {unknown[0]!r}; the axes are {', '.join(AXES)}")
        strides = self._strides()
        for axis in AXES:
            value = coords.get(axis, 0)
            if not 0 <= value < self.size(axis):
                raise LayoutError(f"{axis}={value} is outside 0..{self.size(axis) - 1}")
        return sum(coords.get(axis, 0) * strides[axis] for axis in AXES)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank={rank} is outside 0..{self.world_size - 1} for {self}")

    # ----- groups ----------------------------------------------------------------------------
    def groups(self, axis: str) -> list[list[int]]:
        """Rank lists of every group along ``axis`` (``"dp"``, ``"tp-pp"``, ..., ``"embedding"``).

        A composite axis such as ``"tp-pp"`` (the model-parallel group) holds the ranks that
        differ only in those coordinates. Within a group ranks vary in the layout's order (first
        axis fastest); groups are listed with the remaining axes in the same order. This is
        exactly what megatron-core's ``RankGenerator.get_ranks(axis)`` returns.
        """
        if axis == EMBEDDING:
            return self.embedding_groups()
        wanted = axis.lower().split("-")
        if on_expert_grid(wanted):
            known, sizes, order = EXPERT_AXES, self.expert_sizes(), expert_order(self._axes)
        else:
            known, sizes, order = AXES, {a: self.size(a) for a in AXES}, self._axes
        if not wanted or any(a not in known for a in wanted) or len(set(wanted)) != len(wanted):
            raise LayoutError(
                f"unknown group axis {axis!r}; use one or more of {AXES} (or of the expert "
                f"grid's {EXPERT_AXES}) joined by '-', or 'embedding'"
            )
        return grid_groups(sizes, order, wanted)

    def expert_sizes(self) -> dict[str, int]:
        """The expert grid's axis sizes (``EXPERT_AXES``)."""
        return {"tp": self.tp, "ep": self.ep, "edp": self.dp * self.cp // self.ep,
                "pp": self.pp}

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The group along ``axis`` that contains ``rank``."""
        self._check_rank(rank)
        return next(g for g in self.groups(axis) if rank in g)

    def role_size(self, role: str) -> int:
        """Ranks in each group of ``role``: the gradient reduction and ZeRO's sharding span
        ``dp * cp`` ranks."""
        size, axes = 1, ROLES[role].axes
        sizes = self.expert_sizes() if on_expert_grid(axes) else {a: self.size(a) for a in AXES}
        for axis in axes:
            size *= sizes[axis]
        return size

    def role_rank(self, role: str, rank: int) -> int:
        """``rank``'s place in its group of ``role`` (what ``Group.rank()`` says there)."""
        return self.group_of(role_key(role), rank).index(rank)

    def role_groups(self, role: str) -> list[list[int]]:
        """Rank lists of every group of ``role`` (``ROLES``, or ``"embedding"``)."""
        return self.groups(role_key(role))

    def embedding_groups(self) -> list[list[int]]:
        """The ranks of each pipeline holding the first and the last stage: where tied input
        and output embeddings live (one rank when the placement puts both there)."""
        last = self.last_stage_pp_rank
        return [sorted({g[0], g[last]}) for g in self.groups("pp")]

    @property
    def last_stage_pp_rank(self) -> int:
        """The pipeline rank of the last stage: ``pp - 1``, or 0 with the V placement."""
        return stage_rank(self.pp * self.vpp - 1, self.pp, self.stage_placement)

    @property
    def embedding_split(self) -> bool:
        """Whether a tied embedding has two copies, on two pipeline ranks."""
        return self.last_stage_pp_rank != 0

    # ----- placement on nodes ----------------------------------------------------------------
    def node_of(self, rank: int, ranks_per_node: int) -> int:
        """Node index of ``rank`` when nodes hold ``ranks_per_node`` consecutive ranks."""
        self._check_rank(rank)
        return rank // ranks_per_node

    def crossing_groups(self, axis: str, ranks_per_node: int) -> list[list[int]]:
        """Groups of ``axis`` whose ranks span more than one node (slow links inside the group)."""
        return [g for g in self.groups(axis)
                if len({self.node_of(r, ranks_per_node) for r in g}) > 1]

    def crosses_nodes(self, axis: str, ranks_per_node: int) -> bool:
        """Whether any group of ``axis`` spans nodes, without listing the groups: a group of n
        ranks at stride S lies in one aligned block of n * S ranks, so no group crosses when
        that block divides a node, and one does otherwise (``crossing_groups`` agrees; a search
        asks this for thousands of layouts of thousands of ranks)."""
        n = self.size(axis)
        if n == 1 or self.world_size <= ranks_per_node:
            return False
        return ranks_per_node % (n * self._strides()[axis]) != 0

    def placement_warnings(self, ranks_per_node: int) -> list[str]:
        """Human-readable warnings about groups that cross nodes, worst (TP) first."""
        warnings = []
        for axis, why in AXIS_TRAFFIC.items():
            crossing = self.crossing_groups(axis, ranks_per_node)
            if crossing and self.size(axis) > 1:
                warnings.append(f"{len(crossing)} {axis} group(s) cross nodes, e.g. "
                                f"{crossing[0]} ({why})")
        return warnings

    def describe(self) -> str:
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (f"dp={self.dp}{cp}{ep} tp={self.tp} pp={self.pp} vpp={self.vpp} "
                f"order={self.order}")


def valid_sizes(n: int) -> list[int]:
    """Divisors of ``n``: the sizes an axis may take when it must divide ``n``."""
    return _divisors(n)
