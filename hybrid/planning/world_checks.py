"""Where the ranks go (pure: no torch): the launcher's nodes and processes per node against
the layout's world size, and where the nodes meet (``node_rank``, ``rdzv_endpoint``).

Apart from ``validate.py`` because these are the launcher's side of the config: the one
check of it that needs the layout is the world size.
"""

from __future__ import annotations

from hybrid.planning.config import Config
from hybrid.planning.layout import Layout, LayoutError
from hybrid.planning.value_checks import above_zero, positive


def check_world(cfg: Config, layout: Layout) -> None:
    launcher = cfg.launcher
    positive("launcher.nnodes", launcher.nnodes)
    _check_nodes(launcher)
    if launcher.nproc_per_node is None:
        if layout.world_size % launcher.nnodes:
            raise LayoutError(
                f"dp*cp*tp*pp={layout.world_size} ranks cannot be spread evenly over "
                f"launcher.nnodes={launcher.nnodes}; set launcher.nproc_per_node or the sizes")
        return
    positive("launcher.nproc_per_node", launcher.nproc_per_node)
    world = launcher.nnodes * launcher.nproc_per_node
    if world != layout.world_size:
        sizes = f"{layout.dp}*{layout.cp}*{layout.tp}*{layout.pp}" if layout.cp > 1 else \
            f"{layout.dp}*{layout.tp}*{layout.pp}"
        raise LayoutError(
            f"parallel.dp*{'cp*' * (layout.cp > 1)}tp*pp = {sizes} = {layout.world_size} "
            f"but the launcher starts {world} processes (launcher.nnodes={launcher.nnodes} x "
            f"nproc_per_node={launcher.nproc_per_node}); make them equal")


def _check_nodes(launcher) -> None:
    """Where the nodes meet: ``node_rank`` among them, a ``HOST:PORT`` endpoint."""
    if not 0 <= launcher.node_rank < launcher.nnodes:
        raise LayoutError(f"launcher.node_rank={launcher.node_rank} must be in 0.."
                          f"{launcher.nnodes - 1} for launcher.nnodes={launcher.nnodes}")
    above_zero("launcher.rdzv_timeout_s", launcher.rdzv_timeout_s)
    endpoint = launcher.rdzv_endpoint
    if endpoint is None:  # whether the launcher needs one is its own rule (launch.launchers.launcher)
        return
    host, _, port = str(endpoint).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LayoutError(f"launcher.rdzv_endpoint={endpoint} is not HOST:PORT; write node 0's "
                          f"address and a port, e.g. launcher.rdzv_endpoint=node0:29500")

