"""Expert parallelism's second decomposition of the same world (pure: no torch), as
megatron-core folds it: ``ep`` ranks that split the experts are carved out of the ``dp x cp``
ranks; the expert grid's axes are tp, ep, edp (the expert data-parallel ranks:
``dp * cp / ep``) and pp, filled in the layout's order with ``ep`` placed just before ``dp``
(megatron's ``tp-cp-ep-dp-pp``; ``cp`` is 1 in this grid). Its groups equal megatron-core's
``RankGenerator(tp, ep, dp=edp, pp, cp=1, order)``'s, the generator megatron builds its expert
groups from (``tests/test_expert_grid.py``), and its pp groups are the layout's.

What each group does (docs/moe.md): ``ep`` exchanges tokens (the all-to-all), ``edp`` averages
an expert's gradients, ``tp-ep-pp`` holds one copy of every expert. This module plans them;
expert parallelism at run time (the token all-to-all) is not built yet.
"""

from __future__ import annotations

from hybrid.planning.layout import Layout, LayoutError, _dot, _fastest_first

EXPERT_AXES = ("tp", "ep", "edp", "pp")
"""The expert grid's axes; ``edp`` is megatron's expert ``dp``."""


def expert_order(order_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The dense grid's axes (fastest first) with ``ep`` just before ``dp``, ``dp`` renamed
    ``edp`` and ``cp`` dropped (size 1 in the expert grid)."""
    out: list[str] = []
    for axis in order_axes:
        if axis == "dp":
            out += ["ep", "edp"]
        elif axis != "cp":
            out.append(axis)
    return tuple(out)


def check_ep(layout: Layout, ep: int, experts: int = 0) -> None:
    """``ep`` must divide ``dp * cp`` (the ranks it is carved from) and the experts; one
    ``LayoutError`` line with the fix."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise LayoutError(f"parallel.ep={ep!r} must be an integer >= 1")
    width = layout.dp * layout.cp
    if width % ep:
        fits = [d for d in range(1, width + 1) if width % d == 0]
        raise LayoutError(f"parallel.ep={ep} does not divide dp*cp={width} (the ranks experts "
                          f"are spread over); choose ep in {{{', '.join(map(str, fits))}}}")
    if _pp_groups(layout, ep) != layout.groups("pp"):  # megatron asserts this, at any ep
        raise LayoutError(f"parallel.order={layout.order} keeps cp apart from dp, so the expert "
                          f"grid's pipelines would not be the layout's; expert parallelism "
                          f"needs cp next to dp (megatron's tp-cp-ep-dp-pp): use "
                          f"order=tp-cp-dp-pp")
    if ep > 1 and layout.pp > 1 and layout.axes[-1] != "pp" and ep != layout.cp:
        raise LayoutError(f"parallel.order={layout.order} with pp={layout.pp} and ep={ep}: "
                          f"the attention's and the experts' data-parallel sizes differ, which "
                          f"megatron allows only with pp slowest; use order=tp-cp-dp-pp")
    if experts and experts % ep:
        fits = [d for d in range(1, width + 1) if width % d == 0 and experts % d == 0]
        raise LayoutError(f"parallel.ep={ep} does not divide model.experts={experts}; choose "
                          f"ep in {{{', '.join(map(str, fits))}}}")


def expert_groups(layout: Layout, ep: int, axes: str) -> list[list[int]]:
    """Rank lists of every group of the expert grid along ``axes`` (``"ep"``, ``"edp"``,
    ``"tp-ep"``, ``"tp-ep-pp"``, ...: ``EXPERT_AXES`` joined by '-'), in megatron's order:
    within a group the first axis fastest, groups listed by the other axes likewise."""
    check_ep(layout, ep)
    return _grid_groups(layout, ep, axes)


def _pp_groups(layout: Layout, ep: int) -> list[list[int]]:
    return _grid_groups(layout, ep, "pp")


def _grid_groups(layout: Layout, ep: int, axes: str) -> list[list[int]]:
    wanted = axes.lower().split("-")
    if any(a not in EXPERT_AXES for a in wanted) or len(set(wanted)) != len(wanted):
        raise LayoutError(f"unknown expert group axes {axes!r}; use one or more of "
                          f"{', '.join(EXPERT_AXES)} joined by '-'")
    sizes = {"tp": layout.tp, "ep": ep, "edp": layout.dp * layout.cp // ep, "pp": layout.pp}
    order = expert_order(layout.axes)
    strides, stride = {}, 1
    for axis in order:
        strides[axis] = stride
        stride *= sizes[axis]
    inner = [a for a in order if a in wanted]
    outer = [a for a in order if a not in wanted]
    offsets = [_dot(idx, [strides[a] for a in inner])
               for idx in _fastest_first([sizes[a] for a in inner])]
    return [[base + off for off in offsets]
            for base in (_dot(idx, [strides[a] for a in outer])
                         for idx in _fastest_first([sizes[a] for a in outer]))]
