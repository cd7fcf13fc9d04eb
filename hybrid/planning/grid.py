"""The arithmetic of a rank grid (pure): every group along some axes of a grid filled in a
given order, as megatron-core's ``RankGenerator`` lists them. ``hybrid.planning.layout`` fills
the dense grid with it, and expert parallelism's second decomposition of the same world."""

from __future__ import annotations

import itertools


def expert_order(order_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The expert grid's axes, fastest first: the layout's with ``ep`` just before ``dp``,
    ``dp`` renamed ``edp`` and ``cp`` dropped (folded into ``ep`` and ``edp``): megatron's
    ``tp-cp-ep-dp-pp`` read with cp=1."""
    out: list[str] = []
    for axis in order_axes:
        if axis == "dp":
            out += ["ep", "edp"]
        elif axis != "cp":
            out.append(axis)
    return tuple(out)


def grid_groups(sizes: dict[str, int], order: tuple[str, ...], wanted: list[str]
                ) -> list[list[int]]:
    """Rank lists of every group along the ``wanted`` axes of the grid whose axes, fastest
    first, are ``order`` with ``sizes``: within a group the first axis fastest, groups listed
    by the other axes likewise (megatron-core's ``RankGenerator.get_ranks``)."""
    strides, stride = {}, 1
    for axis in order:
        strides[axis] = stride
        stride *= sizes[axis]
    inner = [a for a in order if a in wanted]
    outer = [a for a in order if a not in wanted]
    inner_offsets = [_dot(idx, [strides[a] for a in inner])
                     for idx in _fastest_first([sizes[a] for a in inner])]
    return [[base + off for off in inner_offsets]
            for base in (_dot(idx, [strides[a] for a in outer])
                         for idx in _fastest_first([sizes[a] for a in outer]))]


def _fastest_first(shape: list[int]) -> list[tuple[int, ...]]:
    """All index tuples of ``shape`` with the first index varying fastest."""
    return [tuple(reversed(idx)) for idx in itertools.product(*(range(s) for s in reversed(shape)))]


def _dot(idx: tuple[int, ...], strides: list[int]) -> int:
    return sum(i * s for i, s in zip(idx, strides))
