"""A real two-node Slurm cluster on this machine, for tests and for trying docs/multinode.md.

One ``slurmctld`` and two ``slurmd`` (nodes ``n1`` and ``n2``, both ``127.0.0.1`` on their
own ports, 4 CPUs each), authenticated by a ``munged`` with its own key and socket, all with
their state, logs and config in one directory. Nothing of the machine's own Slurm or munge
setup is read or changed: client commands find the cluster through ``SLURM_CONF``.

    python tests/slurm_cluster.py DIR     # start it, print SLURM_CONF=...; Ctrl-C stops it

``start_cluster(directory)`` starts the supervisor (this file run as a script; its code is in
``slurm_daemons.py``, what it finds in ``/proc`` in ``proc_tree.py``) and returns a
``Cluster`` once ``sinfo`` shows both nodes idle; ``Cluster.stop()`` cancels every job, stops
the daemons and kills whatever the jobs left. The supervisor is a child subreaper: the
``slurmstepd`` processes that daemonize are reparented to it rather than to PID 1 (which may
never reap them in a container), so that it reaps them and can find them at the end. It also
stops everything when its standard input closes, so a test process that dies takes the
cluster with it; a line ``restart NODE`` on it starts that node's slurmd again.

``Cluster.kill_node(name)`` is what losing a machine does to a job (its slurmd, its job steps'
``slurmstepd`` and every process they run, SIGKILLed); ``Cluster.restart_node(name)`` brings
it back. ``SlurmdTimeout`` is short (``slurm_daemons.SLURMD_TIMEOUT_S``) so that Slurm counts
a killed node down within seconds, not the default five minutes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from proc_tree import cmdline, parent, pids_with_env, send_signal
from slurm_daemons import NODES, START_TIMEOUT_S, supervise, write_config

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch")


def missing_requirement() -> str | None:
    """Why a cluster cannot start here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd runs jobs as their user)"
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        return (f"Slurm is not installed ({', '.join(absent)} not found); "
                f"apt-get install slurm-wlm munge")
    return None


@dataclass
class Cluster:
    directory: Path
    conf: Path
    supervisor: subprocess.Popen

    @property
    def env(self) -> dict:
        """The environment that points Slurm's commands (and submitit) at this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(command), env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def kill_node(self, name: str) -> list[int]:
        """Lose machine ``name``: SIGKILL its slurmd, then every process its job steps run
        (they carry ``SLURMD_NODENAME=name`` and this cluster's ``SLURM_CONF``) and the
        ``slurmstepd`` above them. Returns the pids killed."""
        slurmd = int((self.directory / f"slurmd-{name}.pid").read_text())
        # this cluster's tasks only: each pytest-xdist worker runs a cluster of its own with
        # the same node names, and killing the other's n2 tasks hung its job
        tasks = (pids_with_env(f"SLURMD_NODENAME={name}")
                 & pids_with_env(f"SLURM_CONF={self.conf}"))
        steps = {parent(pid) for pid in tasks} - {None}
        steps = {pid for pid in steps if b"slurmstepd" in cmdline(pid)}
        killed = [slurmd, *sorted(steps), *sorted(tasks)]
        for pid in killed:
            send_signal(pid, signal.SIGKILL)
        return killed

    def restart_node(self, name: str) -> None:
        """Start machine ``name``'s slurmd again and wait until both nodes are idle (Slurm
        ends what it still held of a job there once the node registers)."""
        self.supervisor.stdin.write(f"restart {name}\n".encode())
        self.supervisor.stdin.flush()
        _wait_until_idle(self)

    def stop(self) -> None:
        if self.supervisor.poll() is None:
            self.supervisor.stdin.close()
            try:
                self.supervisor.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.supervisor.kill()
                self.supervisor.wait()


def start_cluster(directory: Path) -> Cluster:
    """Start the cluster in ``directory`` and return once both nodes are idle."""
    conf = write_config(directory)
    supervisor = subprocess.Popen([sys.executable, __file__, "--supervise", str(directory)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    cluster = Cluster(directory, conf, supervisor)
    try:
        if supervisor.stdout.readline().strip() != b"started":
            raise RuntimeError(f"the Slurm daemons did not start; see {directory}/*.log")
        _wait_until_idle(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_until_idle(cluster: Cluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        states = cluster.run("sinfo", "--noheader", "--Node", "--format=%N %t").stdout.split()
        if states.count("idle") == len(NODES):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"Slurm nodes not idle after {START_TIMEOUT_S}s ({states}); "
                               f"see {cluster.directory}/*.log")
        time.sleep(0.1)


def main() -> None:
    if sys.argv[1] == "--supervise":
        supervise(Path(sys.argv[2]))
        return
    cluster = start_cluster(Path(sys.argv[1]).resolve())
    print(f"export SLURM_CONF={cluster.conf}   # then sinfo, srun, hybrid-train launcher=slurm; "
          f"Ctrl-C or end of input stops the cluster", flush=True)
    try:
        for line in sys.stdin.buffer:  # ``restart NODE`` lines go on to the supervisor
            cluster.supervisor.stdin.write(line)
            cluster.supervisor.stdin.flush()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
