"""A real two-node Slurm cluster on this machine, for tests and for trying docs/multinode.md.

One ``slurmctld`` and two ``slurmd`` (nodes ``n1`` and ``n2``, both ``127.0.0.1`` on their
own ports, 4 CPUs each), authenticated by a ``munged`` with its own key and socket, all with
their state, logs and config in one directory. Nothing of the machine's own Slurm or munge
setup is read or changed: client commands find the cluster through ``SLURM_CONF``.

    python tests/slurm_cluster.py DIR     # start it, print SLURM_CONF=...; Ctrl-C stops it

``start_cluster(directory)`` starts the supervisor (this file run as a script) and returns a
``Cluster`` once ``sinfo`` shows both nodes idle; ``Cluster.stop()`` cancels every job, stops
the daemons and kills whatever the jobs left. The supervisor is a child subreaper: the
``slurmstepd`` processes that daemonize are reparented to it rather than to PID 1 (which may
never reap them in a container), so that it reaps them and can find them at the end. It also
stops everything when its standard input closes, so a test process that dies takes the
cluster with it; a line ``restart NODE`` on it starts that node's slurmd again.

``Cluster.kill_node(name)`` is what losing a machine does to a job (its slurmd, its job steps'
``slurmstepd`` and every process they run, SIGKILLed); ``Cluster.restart_node(name)`` brings
it back. ``SlurmdTimeout`` is short (``SLURMD_TIMEOUT_S``) so that Slurm counts a killed
node down within seconds, not the default five minutes.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch")
NODES = ("n1", "n2")
CPUS_PER_NODE = 4
START_TIMEOUT_S = 30.0
SLURMD_TIMEOUT_S = 10
"""How long slurmctld waits for a silent slurmd before it counts the node down (Slurm's
default is 300 s); slurmd answers its pings at once, even on a loaded machine."""
PR_SET_CHILD_SUBREAPER = 36


def missing_requirement() -> str | None:
    """Why a cluster cannot start here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd runs jobs as their user)"
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        return (f"Slurm is not installed ({', '.join(absent)} not found); "
                f"apt-get install slurm-wlm munge")
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def write_config(directory: Path) -> Path:
    """slurm.conf (and the munge key) for a cluster living in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)  # munged refuses a socket directory others can write
    key = directory / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (directory / "plugstack.conf").write_text("")  # not the machine's /etc/slurm one
    ctld_port, *node_ports = _free_ports(1 + len(NODES))
    nodes = "\n".join(
        f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={CPUS_PER_NODE} State=UNKNOWN" for name, port in zip(NODES, node_ports))
    conf = directory / "slurm.conf"
    conf.write_text(f"""\
ClusterName=hybridtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={directory}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool-%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd-%n.log
PlugStackConfig={directory}/plugstack.conf
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerParameters=batch_sched_delay=0
MinJobAge=3600
KillWait=2
SlurmdTimeout={SLURMD_TIMEOUT_S}
ReturnToService=2
MpiDefault=none
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _daemon_commands(directory: Path, conf: Path) -> list[list[str]]:
    munge = [
        "munged", "--foreground", "--force", f"--socket={directory}/munge.socket",
        f"--key-file={directory}/munge.key", f"--pid-file={directory}/munged.pid",
        f"--log-file={directory}/munged.log", f"--seed-file={directory}/munged.seed"]
    ctld = ["slurmctld", "-D", "-i", "-f", str(conf)]
    return [munge, ctld] + [["slurmd", "-D", "-f", str(conf), "-N", name] for name in NODES]


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _children_of(pid: int) -> list[int]:
    return [int(entry) for entry in os.listdir("/proc")
            if entry.isdigit() and _parent(int(entry)) == pid]


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        children = _children_of(frontier.pop())
        found += children
        frontier += children
    return found


def _reap(*_args) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def supervise(directory: Path) -> None:
    """The supervisor: start the daemons, then reap until standard input closes or a
    SIGTERM comes; then cancel the jobs and stop everything it started."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGTERM, _interrupt)
    conf = directory / "slurm.conf"
    env = dict(os.environ, SLURM_CONF=str(conf))
    log = open(directory / "daemons.log", "ab")
    commands = _daemon_commands(directory, conf)
    try:
        for command in commands:
            subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
            if command[0] == "munged":
                _wait_for_path(directory / "munge.socket")
        print("started", flush=True)
        for line in sys.stdin.buffer:  # until the test process closes it, or dies
            restart = line.decode().split()
            if restart[:1] == ["restart"]:
                subprocess.Popen(["slurmd", "-D", "-f", str(conf), "-N", restart[1]], env=env,
                                 stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    except KeyboardInterrupt:
        pass
    finally:
        subprocess.run(["scancel", "--full", "--quiet", "--user=root"], env=env,
                       timeout=10, check=False, stderr=subprocess.DEVNULL)
        _stop_descendants()


def _wait_for_path(path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {START_TIMEOUT_S}s")
        time.sleep(0.02)


def _stop_descendants() -> None:
    """SIGTERM the daemons (they clean up), then SIGKILL whatever is left, jobs included."""
    me = os.getpid()
    for pid in _descendants(me):
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while _descendants(me) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    for pid in _descendants(me):
        _signal(pid, signal.SIGKILL)
    while _descendants(me):
        _reap()
        time.sleep(0.02)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


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
        (they carry ``SLURMD_NODENAME=name``) and the ``slurmstepd`` above them. Returns
        the pids killed."""
        slurmd = int((self.directory / f"slurmd-{name}.pid").read_text())
        tasks = _pids_with_env(f"SLURMD_NODENAME={name}")
        steps = {_parent(pid) for pid in tasks} - {None}
        steps = {pid for pid in steps if b"slurmstepd" in _cmdline(pid)}
        killed = [slurmd, *sorted(steps), *sorted(tasks)]
        for pid in killed:
            _signal(pid, signal.SIGKILL)
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


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _pids_with_env(entry: str) -> set[int]:
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
