"""The parallel axes and the roles built on them, declared once (pure: no torch): the axes'
names and Megatron's default order, the order people read them in, what crosses each axis,
the roles consumers ask for (``ROLES``) and expert parallelism's second grid (``EXPERT_AXES``).

Apart from ``layout.py`` (the rank grid's arithmetic over these names) because these are the
vocabulary every consumer shares: adding an axis or a role starts here (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("tp", "cp", "dp", "pp")
"""The parallel axes, in Megatron's default order (fastest-varying first): the one place that
names them. Each is also a ``Layout`` field holding its size."""
DEFAULT_ORDER = "-".join(AXES)
COORD_ORDER = ("dp", "cp", "tp", "pp")
"""The same axes in the order people read them: ``Layout.coords``' keys, rank tables."""
AXIS_TRAFFIC = {
    "tp": "TP all-reduces run every layer: keep TP inside a node",
    "cp": "CP passes keys and values around a ring every layer",
    "pp": "PP sends activations between neighbouring stages",
    "dp": "DP all-reduces gradients once per step",
}
"""What crosses each axis's groups, heaviest first: why a group that spans nodes is slow."""


@dataclass(frozen=True)
class Role:
    """What a group of ranks does together: the axes its ranks differ in."""

    axes: tuple[str, ...]
    doc: str


ROLES = {
    "data": Role(("dp",), "read different samples of the global batch (the loader's split)"),
    "gradient": Role(("cp", "dp"), "average their gradients once per step (DP reduction)"),
    "sharding": Role(("cp", "dp"), "share one copy of optimizer state (and gradients) under "
                                   "ZeRO"),
    "loss": Role(("cp", "dp"), "average the last stage's losses into the step's loss"),
    "context": Role(("cp",), "split each sequence and pass keys and values around a ring"),
    "tensor": Role(("tp",), "split each weight matrix (tensor and sequence parallelism)"),
    "pipeline": Role(("pp",), "run the stages of one pipeline (point-to-point messages)"),
    "model": Role(("tp", "pp"), "hold one copy of every parameter between them (global norms)"),
    "expert": Role(("ep",), "hold different experts and exchange their tokens (all-to-all)"),
    "expert_gradient": Role(("edp",), "average an expert's gradients once per step"),
    "expert_sharding": Role(("edp",), "share one copy of an expert's optimizer state "
                                      "under ZeRO"),
    "expert_model": Role(("tp", "ep", "pp"), "hold one copy of every expert between them "
                                             "(global norms)"),
}
"""The roles every consumer asks for (``ParallelGroups.<role>``); ``EMBEDDING`` is the one
role not made of whole axes. A parameter's ``Placement`` (``hybrid.planning.param_spec``) names
the roles that reduce, shard and count it: the dense ones above, or the ``expert_*`` ones,
which live on the expert grid (``EXPERT_AXES``): at ``ep=1`` its ``edp`` groups are the
``cp-dp`` groups and its ``tp-ep-pp`` groups the ``tp-pp`` ones (the same torch groups)."""
EXPERT_AXES = ("tp", "ep", "edp", "pp")
"""Expert parallelism's second decomposition of the same world (megatron-core's MoE folding):
``ep`` ranks that hold different experts are carved out of ``dp x cp``, ``edp`` (megatron's
expert ``dp``: ``dp * cp / ep``) is the rest; tp and pp are the layout's. Named in the order
their role keys list them (``hybrid.planning.expert_grid``)."""
EMBEDDING = "embedding"
"""The ranks of each pipeline holding its first and last stage (a tied embedding's copies)."""


def on_expert_grid(axes) -> bool:
    return any(axis in ("ep", "edp") for axis in axes)

