"""How the nodes' agents meet (``Rendezvous``), and the one line when they do not."""

from __future__ import annotations

import re
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from launch.launchers.failures import LaunchFailed


@dataclass(frozen=True)
class Rendezvous:
    """How this node's agent meets the others'.

    One node (the default): a c10d rendezvous on ``localhost:0``, a free port, never a fixed
    one. Several: torch's static rendezvous at ``endpoint`` (``HOST:PORT`` of node 0, which
    hosts the store), so that ``node_rank`` fixes which global ranks a node runs (node ``i``
    runs ranks ``i * nproc`` to ``(i + 1) * nproc - 1``): c10d's dynamic rendezvous would
    order nodes by host name and process id instead. ``timeout_s`` bounds the wait for the
    other nodes.
    """

    nnodes: int = 1
    node_rank: int = 0
    endpoint: Optional[str] = None
    timeout_s: float = 300.0
    run_id: str = "hybrid"
    """Static rendezvous: the store prefix of this meeting (an elastic job's later attempts
    meet at the same endpoint under their own)."""

    def launch_options(self) -> dict:
        if self.endpoint is None:
            return {"min_nodes": 1, "max_nodes": 1, "rdzv_backend": "c10d",
                    "rdzv_endpoint": "localhost:0", "run_id": uuid.uuid4().hex}
        return {"min_nodes": self.nnodes, "max_nodes": self.nnodes, "rdzv_backend": "static",
                "rdzv_endpoint": self.endpoint, "run_id": self.run_id,
                "rdzv_configs": {"rank": self.node_rank, "timeout": int(self.timeout_s)}}


class RendezvousFailure(LaunchFailed):
    """The nodes did not meet: one line naming the endpoint and how many arrived."""


def rendezvous_failure(rendezvous: Rendezvous, err: Exception) -> RendezvousFailure:
    """One line from the store's own error (``... 1/2 clients joined``, a connect timeout)."""
    where, waited = rendezvous.endpoint, f"{rendezvous.timeout_s:g}s"
    joined = re.search(r"(\d+)/(\d+) clients joined", str(err))
    if joined:
        others = "1" if rendezvous.nnodes == 2 else f"1..{rendezvous.nnodes - 1}"
        return RendezvousFailure(
            f"rendezvous at {where} timed out after {waited}: {joined[1]} of {joined[2]} nodes "
            f"arrived; start hybrid-train with launcher.node_rank={others} on the other "
            f"nodes, or raise launcher.rdzv_timeout_s")
    return RendezvousFailure(
        f"node {rendezvous.node_rank} could not reach node 0's rendezvous at {where} within "
        f"{waited}; start node 0 (launcher.node_rank=0) with the same launcher.rdzv_endpoint, "
        f"check that this node can reach it, or raise launcher.rdzv_timeout_s "
        f"({str(err).strip().splitlines()[0][:160]})")


CONNECT_ATTEMPT_S = 2.0
"""The longest single connection attempt while waiting for node 0 (it may not be up yet)."""


def wait_for_node0(rendezvous: Rendezvous) -> None:
    """On a node other than 0: wait until node 0's endpoint accepts a connection, for at most
    ``timeout_s`` in all, else raise ``RendezvousFailure``. torch's store client would try
    again after its own timeout (twice the wait) and print C++ stack frames each time; this
    fails once, on time, in one line, before torch's store is made."""
    if rendezvous.endpoint is None or rendezvous.node_rank == 0:
        return
    host, _, port = rendezvous.endpoint.rpartition(":")
    deadline = time.monotonic() + rendezvous.timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)),
                                          timeout=max(0.05, min(left, CONNECT_ATTEMPT_S))):
                return
        except OSError as err:
            if deadline - time.monotonic() <= 0:
                raise rendezvous_failure(rendezvous, err) from None
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))  # node 0 starting
