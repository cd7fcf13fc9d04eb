"""What Slurm can say before and while a job waits: whether the partition's nodes can ever
hold the job (``sinfo``), and the pending reasons that never clear by themselves. A job that
asks for more than any node offers would otherwise wait in the queue forever, and
``hybrid-train`` with it."""

from __future__ import annotations

import subprocess
from typing import Optional

NEVER_CLEARS = {
    "PartitionConfig": "it asks for more than the partition's nodes offer: CPUs, memory, GPUs",
    "PartitionNodeLimit": "more nodes than the partition allows",
    "PartitionTimeLimit": "a longer time than the partition allows",
    "BadConstraints": "a constraint no node satisfies",
    "InvalidAccount": "an account it may not use",
    "InvalidQOS": "a QOS it may not use",
    "DependencyNeverSatisfied": "a dependency that can never be met",
}
"""Pending reasons that do not clear by themselves: the job would wait forever."""


def partition_nodes(partition: Optional[str]) -> list[tuple[int, int]]:
    """``(CPUs per node, nodes)`` of each kind of node in ``partition`` (the default one when
    None), from ``sinfo``; empty when sinfo cannot say."""
    command = ["sinfo", "--noheader", "--format=%c %D"]
    if partition:
        command.append(f"--partition={partition}")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    kinds = []
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        cpus, _, count = line.strip().partition(" ")
        if cpus.rstrip("+").isdigit() and count.isdigit():
            kinds.append((int(cpus.rstrip("+")), int(count)))
    return kinds


def partition_problem(params: dict, kinds: list[tuple[int, int]]) -> Optional[str]:
    """Why the job's nodes can never be found in the partition, or None (also when unknown)."""
    if not kinds:
        return None
    cpus, nodes = params.get("cpus_per_task", 1), params.get("nodes", 1)
    fitting = sum(count for per_node, count in kinds if per_node >= cpus)
    if fitting >= nodes:
        return None
    most = max(per_node for per_node, _ in kinds)
    if fitting == 0:
        return (f"the job asks for {cpus} CPUs per node (launcher.cpus_per_task, by default one "
                f"per rank) but the partition's nodes have at most {most}: Slurm would keep it "
                f"pending forever; set launcher.cpus_per_task={most} (ranks then share cores) "
                f"or use more nodes with fewer ranks each")
    return (f"launcher.nnodes={nodes} but the partition has {fitting} node(s) with {cpus} CPUs "
            f"or more: Slurm would keep the job pending forever; lower launcher.nnodes or "
            f"launcher.cpus_per_task")
