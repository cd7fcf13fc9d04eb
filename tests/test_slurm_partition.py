"""What Slurm says before and while a job waits (pure parts; the real cluster's are in
test_slurm.py): nodes that can never hold the job, and pending reasons that never clear."""

from types import SimpleNamespace

import pytest

from launch.launchers.registered import LAUNCHERS  # first: registers them in launcher.name's order
import launch.launchers.slurm_job as slurm_job
from launch.launchers.failures import LaunchFailed
from launch.launchers.slurm_partition import partition_problem


def test_a_partition_that_can_hold_the_job_or_cannot_say_has_no_problem():
    assert list(LAUNCHERS) == ["local", "torchrun", "slurm"]
    assert partition_problem({"cpus_per_task": 4, "nodes": 2}, [(4, 2)]) is None
    assert partition_problem({"cpus_per_task": 4, "nodes": 2}, [(2, 8), (8, 2)]) is None
    assert partition_problem({"cpus_per_task": 64, "nodes": 2}, []) is None  # sinfo silent


def test_too_many_cpus_or_nodes_is_one_line_with_the_fix():
    line = partition_problem({"cpus_per_task": 8, "nodes": 1}, [(2, 4), (4, 1)])
    assert "asks for 8 CPUs per node" in line and "set launcher.cpus_per_task=4" in line
    line = partition_problem({"cpus_per_task": 4, "nodes": 2}, [(2, 4), (4, 1)])
    assert line.startswith("launcher.nnodes=2 but the partition has 1 node(s) with 4 CPUs")


class _Job:
    job_id, num_tasks, cancelled = "42", 1, False

    def task(self, i):
        return SimpleNamespace(paths=SimpleNamespace(
            result_pickle=SimpleNamespace(exists=lambda: False),
            stdout=SimpleNamespace(exists=lambda: False)))

    def cancel(self, check=True):
        self.cancelled = True


@pytest.mark.parametrize("reason, waits", [("PartitionConfig", False), ("Resources", True)])
def test_a_job_pending_for_a_reason_that_never_clears_is_cancelled(monkeypatch, reason, waits):
    """PartitionConfig ends the wait at the first look, cancelled, in one line; Resources
    (busy nodes) is waited on."""
    looks = []

    def state(job_id):
        looks.append(job_id)
        if waits and len(looks) > 1:
            return "CANCELLED", ""  # (here: end the test's wait)
        return "PENDING", reason

    monkeypatch.setattr(slurm_job, "job_state_and_reason", state)
    monkeypatch.setattr(slurm_job, "POLL_S", 0.01)
    job = _Job()
    if waits:
        slurm_job.wait_for(job)
        assert not job.cancelled and len(looks) >= 2
        return
    with pytest.raises(LaunchFailed, match=r"slurm job 42 cannot start: Slurm keeps it pending "
                                           r"for PartitionConfig \(it asks for more"):
        slurm_job.wait_for(job)
    assert job.cancelled
