"""The daemons of the local Slurm cluster (``slurm_cluster.py``): their config (slurm.conf
and the munge key) and the supervisor that starts them, reaps what they leave and stops them
all at the end.

Apart from ``slurm_cluster.py`` (what a test holds: ``Cluster``) because the supervisor runs
in a process of its own (``slurm_cluster.py --supervise DIR``), a child subreaper that the
test process only talks to through its standard input.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from proc_tree import descendants, send_signal

NODES = ("n1", "n2")
CPUS_PER_NODE = 4
START_TIMEOUT_S = 30.0
SLURMD_TIMEOUT_S = 10
"""How long slurmctld waits for a silent slurmd before it counts the node down (Slurm's
default is 300 s); slurmd answers its pings at once, even on a loaded machine."""
PR_SET_CHILD_SUBREAPER = 36


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


def reap_children(*_args) -> None:
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
    signal.signal(signal.SIGCHLD, reap_children)
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
        stop_descendants()


def _wait_for_path(path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {START_TIMEOUT_S}s")
        time.sleep(0.02)


def stop_descendants() -> None:
    """SIGTERM the daemons (they clean up), then SIGKILL whatever is left, jobs included."""
    me = os.getpid()
    for pid in descendants(me):
        send_signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while descendants(me) and time.monotonic() < deadline:
        reap_children()
        time.sleep(0.05)
    for pid in descendants(me):
        send_signal(pid, signal.SIGKILL)
    while descendants(me):
        reap_children()
        time.sleep(0.02)

