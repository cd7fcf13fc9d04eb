"""Expert parallelism's second decomposition of the same world (pure: no torch), as
megatron-core folds it: ``ep`` ranks that split the experts are carved out of the ``dp x cp``
ranks; the expert grid's axes are tp, ep, edp (the expert data-parallel ranks:
``dp * cp / ep``) and pp, filled in the layout's order with ``ep`` placed just before ``dp``
(megatron's ``tp-cp-ep-dp-pp``; ``cp`` is 1 in this grid). Its groups equal megatron-core's
``RankGenerator(tp, ep, dp=edp, pp, cp=1, order)``'s, the generator megatron builds its expert
groups from (``tests/test_expert_grid.py``), and its pp groups are the layout's.

What each group does (docs/moe.md): ``ep`` exchanges tokens (the all-to-all), ``edp`` averages
an expert's gradients, ``tp-ep-pp`` holds one copy of every expert. ``Layout.ep`` carries the
size, ``Layout.groups`` makes the groups (the ``expert*`` roles of ``hybrid.planning.layout``
name them) and ``ParallelGroups`` builds them like any other; this module holds the rules and
the groups of a layout at another ep.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from hybrid.planning.grid import expert_order, grid_groups
from hybrid.planning.layout import EXPERT_AXES, Layout, LayoutError

__all__ = ["EXPERT_AXES", "check_ep", "expert_groups", "expert_order"]


def check_ep(layout: Layout, ep: int, experts: int = 0) -> None:
    """``ep`` must divide ``dp * cp`` (the ranks it is carved from) and the experts; one
    ``LayoutError`` line with the fix."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise LayoutError(f"parallel.ep={ep!r} must be an integer >= 1")
    width = layout.dp * layout.cp
    at_ep = replace(layout, ep=ep)  # raises when ep does not divide dp * cp
    if _expert_grid(at_ep, ["pp"]) != layout.groups("pp"):  # megatron asserts this, at any ep
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
        raise LayoutError(f"parallel.ep={ep} does not divide model.moe.experts={experts}; choose "
                          f"ep in {{{', '.join(map(str, fits))}}}")


def expert_groups(layout: Layout, ep: int, axes: str) -> list[list[int]]:
    """Rank lists of every group of the expert grid at ``ep`` along ``axes`` (``"ep"``,
    ``"edp"``, ``"tp-ep"``, ``"tp-ep-pp"``, ...: ``EXPERT_AXES`` joined by '-'), in megatron's
    order: within a group the first axis fastest, groups listed by the other axes likewise."""
    check_ep(layout, ep)
    wanted = axes.lower().split("-")
    if any(a not in EXPERT_AXES for a in wanted) or len(set(wanted)) != len(wanted):
        raise LayoutError(f"unknown expert group axes {axes!r}; use one or more of "
                          f"{', '.join(EXPERT_AXES)} joined by '-'")
    at_ep = replace(layout, ep=ep)
    if "ep" in wanted or "edp" in wanted:
        return at_ep.groups(axes)
    return _expert_grid(at_ep, wanted)  # tp, pp or tp-pp alone: the expert grid's own


def _expert_grid(layout: Layout, wanted: list[str]) -> list[list[int]]:
    return grid_groups(layout.expert_sizes(), expert_order(layout.axes), wanted)


def expert_problem(cfg, layout: Layout) -> Optional[str]:
    """What a config with ``parallel.ep`` > 1 must also be, one line (None: fine): the layout
    rules of ``check_ep`` and a model with experts. Every DP strategy runs on the expert
    placement (its buckets carry their own groups: ``hybrid.dp.buckets``)."""
    ep = cfg.parallel.ep
    if ep == 1:
        return None
    try:
        check_ep(layout, ep, cfg.model.moe.experts)
    except LayoutError as err:
        return str(err)
    if cfg.model.moe.experts == 0:
        return (f"parallel.ep={ep} spreads experts, but model.moe.experts=0 (a dense model); set "
                f"model.moe.experts (e.g. model=moe-tiny) or parallel.ep=1")
    return None


def replica_units(layout: Layout, dp_of_rank: Sequence[int]) -> list[int]:
    """Per DP replica, the index of its balance unit: the replicas that share an expert group
    (their experts' all-to-all needs every member's micro-batch, so ``dp_balance=dynamic``
    gives them one share); every replica its own at ``ep=1``. Units are numbered in order."""
    label = list(range(layout.dp))
    if layout.ep > 1:
        for group in layout.role_groups("expert"):
            members = {dp_of_rank[rank] for rank in group}
            low = min(label[m] for m in members)
            tied = {label[m] for m in members}
            label = [low if x in tied else x for x in label]
    order = {x: i for i, x in enumerate(dict.fromkeys(label))}
    return [order[x] for x in label]
