"""Pure rank arithmetic for a DP x TP x PP layout (no torch).

A layout is a grid of ``dp * tp * pp`` ranks. The ``order`` string names the axes from the
fastest-varying to the slowest, exactly as megatron-core's ``RankGenerator`` reads it: with the
default ``"tp-dp-pp"`` the ranks of one TP group are consecutive (so they sit inside one node),
and ``rank = tp + dp * tp_size + pp * tp_size * dp_size``.

Every group of every axis is a slice of this one grid, so all groups agree with each other.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hybrid.planning.schedules.actions import PLACEMENTS, stage_rank
from hybrid.errors import UserError

AXES = ("tp", "dp", "pp")
DEFAULT_ORDER = "tp-dp-pp"


class LayoutError(UserError):
    """A user error in the parallel layout or the config that it must fit; one line, with the fix."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_order(order: str) -> tuple[str, ...]:
    """``"tp-dp-pp"`` -> ``("tp", "dp", "pp")``; the string must name each axis exactly once."""
    names = tuple(order.lower().split("-"))
    if sorted(names) != sorted(AXES):
        raise LayoutError(
            f"parallel.order={order!r} is not a permutation of {'-'.join(AXES)}; "
            f"use e.g. order=tp-dp-pp (Megatron's default, TP fastest) or order=tp-pp-dp"
        )
    return names


@dataclass(frozen=True)
class Layout:
    """The rank grid of one job: sizes of each axis and the order in which ranks fill it."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    order: str = DEFAULT_ORDER
    vpp: int = 1
    stage_placement: str = "loop"
    """Which pipeline rank holds each virtual stage: ``hybrid.planning.schedules.actions.stage_rank``
    ("loop", or "v" for zb-v; ``placement_warnings`` is about nodes, not this). It decides where the first and last stage, and so the tied
    embedding, live."""
    _axes: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "vpp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name}={value!r} must be an integer >= 1")
        if self.stage_placement not in PLACEMENTS:
            raise LayoutError(f"stage_placement={self.stage_placement!r} is not one of "
                              f"{PLACEMENTS}")
        object.__setattr__(self, "_axes", parse_order(self.order))

    # ----- sizes and coordinates -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes from fastest- to slowest-varying."""
        return self._axes

    def size(self, axis: str) -> int:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}[axis]

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for axis in self._axes:
            strides[axis] = stride
            stride *= self.size(axis)
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> ``{"dp": i, "tp": j, "pp": k}``."""
        self._check_rank(rank)
        strides = self._strides()
        return {axis: (rank // strides[axis]) % self.size(axis) for axis in ("dp", "tp", "pp")}

    def rank(self, *, dp: int = 0, tp: int = 0, pp: int = 0) -> int:
        """``(dp, tp, pp)`` coordinates -> global rank."""
        coords = {"dp": dp, "tp": tp, "pp": pp}
        for axis, value in coords.items():
            if not 0 <= value < self.size(axis):
                raise LayoutError(f"{axis}={value} is outside 0..{self.size(axis) - 1}")
        strides = self._strides()
        return sum(coords[axis] * strides[axis] for axis in AXES)

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
        if axis == "embedding":
            return self.embedding_groups()
        wanted = axis.lower().split("-")
        if not wanted or any(a not in AXES for a in wanted) or len(set(wanted)) != len(wanted):
            raise LayoutError(
                f"unknown group axis {axis!r}; use one or more of {AXES} joined by '-', "
                f"or 'embedding'"
            )
        strides = self._strides()
        inner = [a for a in self._axes if a in wanted]
        outer = [a for a in self._axes if a not in wanted]
        inner_offsets = [_dot(idx, [strides[a] for a in inner])
                         for idx in _fastest_first([self.size(a) for a in inner])]
        return [[base + off for off in inner_offsets]
                for base in (_dot(idx, [strides[a] for a in outer])
                             for idx in _fastest_first([self.size(a) for a in outer]))]

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The group along ``axis`` that contains ``rank``."""
        self._check_rank(rank)
        return next(g for g in self.groups(axis) if rank in g)

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
        for axis, why in (("tp", "TP all-reduces run every layer: keep TP inside a node"),
                          ("pp", "PP sends activations between neighbouring stages"),
                          ("dp", "DP all-reduces gradients once per step")):
            crossing = self.crossing_groups(axis, ranks_per_node)
            if crossing and self.size(axis) > 1:
                warnings.append(f"{len(crossing)} {axis} group(s) cross nodes, e.g. "
                                f"{crossing[0]} ({why})")
        return warnings

    def describe(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp} vpp={self.vpp} order={self.order}"


def _fastest_first(shape: list[int]) -> list[tuple[int, ...]]:
    """All index tuples of ``shape`` with the first index varying fastest."""
    return [tuple(reversed(idx)) for idx in itertools.product(*(range(s) for s in reversed(shape)))]


def _dot(idx: tuple[int, ...], strides: list[int]) -> int:
    return sum(i * s for i, s in zip(idx, strides))


def valid_sizes(n: int) -> list[int]:
    """Divisors of ``n``: the sizes an axis may take when it must divide ``n``."""
    return _divisors(n)
