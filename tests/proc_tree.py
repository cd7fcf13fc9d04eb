"""What ``/proc`` says about processes, for the local Slurm cluster (``slurm_cluster.py``):
a process's parent and descendants, command line and environment, and signals sent to pids
that may be gone already.

Apart from the cluster because both sides need it: the supervisor finds and stops what its
daemons and their jobs started, and the tests find what a job left behind.
"""

from __future__ import annotations

import os
from pathlib import Path


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def children_of(pid: int) -> list[int]:
    return [int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and parent(int(entry)) == pid]


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        children = children_of(frontier.pop())
        found += children
        frontier += children
    return found


def send_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def pids_with_env(entry: str) -> set[int]:
    """Processes whose environment holds ``entry`` (``NAME=value``)."""
    found, wanted = set(), entry.encode()
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and wanted in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                found.add(int(name))
        except OSError:
            continue
    return found


def leftover_processes(directory: Path) -> list[str]:
    """Command lines of processes still running from the cluster in ``directory``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if str(directory) in command and entry.isdigit() and int(entry) != os.getpid():
            found.append(command)
    return found

