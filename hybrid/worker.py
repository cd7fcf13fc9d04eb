"""The entry point of every rank: set up torch.distributed from the launcher's environment,
build the groups of the job's plan and train it. ``launch/`` starts this; ``hybrid/`` never
imports ``launch/``. A rank never plans again: it reads the frozen ``JobPlan`` that
``hybrid-train`` made before launch (``plan.json``).

Any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (plain
``torchrun``, a cluster's own wrapper) can start it too, on a run directory whose
``plan.json`` was written before (``hybrid-train`` writes one into every run directory; a
plain torchrun's placement of ranks on nodes is the one the diagnosis then uses)::

    torchrun --standalone --nproc-per-node 8 -m hybrid.worker RUN_DIR
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid.errors import UserError
from hybrid.groups import ParallelGroups, default_device
from hybrid.planning.config import Config
from hybrid.planning.plan_file import FILE as PLAN_FILE
from hybrid.planning.plan_file import load_plan, plan_from_dict, plan_to_dict
from hybrid.transport import transport_of



def pick_device(cfg: Config) -> torch.device:
    """``train.device``: auto takes this process's GPU when CUDA is available, else the CPU."""
    if cfg.train.device == "cpu":
        return torch.device("cpu")
    device = default_device()
    if cfg.train.device == "cuda" and device.type != "cuda":
        raise UserError("train.device=cuda but CUDA is not available; use train.device=cpu")
    return device


def store_prefix(attempt: int, restart: int) -> str:
    """The workers' prefix in the agent's store: per restart of the group, and per elastic
    attempt after the first (``launch.launchers.elastic`` writes there too)."""
    if not attempt:
        return f"hybrid/attempt_{restart}"
    return f"hybrid/elastic_{attempt}/attempt_{restart}"


def init_distributed(backend: str, timeout: timedelta, attempt: int = 0) -> dist.Store:
    """``init_process_group`` from the launcher's variables, on a store prefixed by the restart
    count.

    Under torch's elastic agent every attempt of a restarted worker group gets the same
    ``MASTER_PORT``: the agent's own store, which still holds the previous attempt's keys
    (every process group's peer addresses). Without a prefix of its own the new group would
    read them and connect to dead workers' ports ("Connection refused"). An elastic job's
    later attempts (``attempt`` > 0: a new layout after nodes left) meet on node 0's same store
    again, so their prefix names the attempt too. Returns the prefixed store (where a failed
    rank publishes its stall report).
    """
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    attempt_store = dist.PrefixStore(store_prefix(attempt, restart), store)
    dist.init_process_group(backend, store=attempt_store, rank=rank, world_size=world,
                            timeout=timeout)
    return attempt_store


def worker_main(plan_dict: dict, run_dir: str, attempt: int = 0) -> dict:
    """Train this rank of the plan (``hybrid.planning.plan_file`` form); returns a summary
    (losses are known on every rank). ``attempt``: an elastic job's attempt (its layout after
    nodes left; 0 otherwise)."""
    from hybrid.data import open_dataset, open_eval_dataset
    from hybrid.pipeline.calibrate import settle_measured_partition
    from hybrid.train import train

    plan = plan_from_dict(plan_dict)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", plan.ranks_per_node))
    if local_world != plan.ranks_per_node:  # a plain torchrun placed the ranks otherwise
        plan = plan.placed(local_world)
    cfg = plan.cfg
    device = pick_device(cfg)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Before the process group: megatron-core's dataset builder would otherwise run its
    # rank-0-first barriers on the world group (hybrid.data.megatron).
    dataset, eval_dataset = open_dataset(plan), open_eval_dataset(plan)
    # A rank stuck in a collective this long fails instead of hanging the job forever.
    timeout = timedelta(seconds=cfg.train.collective_timeout_s)
    store = init_distributed(transport_of(device).backend, timeout, attempt)
    try:
        groups = ParallelGroups.create(plan.layout, device, timeout)
        plan = settle_measured_partition(plan, groups, Path(run_dir))
        return train(plan, groups, Path(run_dir), store, dataset, eval_dataset)
    except UserError as err:
        # The launcher prints a UserError's line and nothing else (launch.launchers.run.failure_line):
        # bad input found on a rank (a damaged checkpoint, a diverging run) is no bug.
        raise UserError(str(err)) from err
    finally:
        dist.destroy_process_group()


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
USAGE = "usage: python -m hybrid.worker RUN_DIR (started by torchrun or a cluster's launcher)"


def main(argv: list[str] | None = None) -> None:
    """``python -m hybrid.worker RUN_DIR``: train this rank of the run in ``RUN_DIR``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        sys.exit(f"error: {USAGE}")
    run_dir = Path(args[0])
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if missing:
        sys.exit(f"error: {', '.join(missing)} not set; {USAGE}")
    try:
        plan_dict = plan_to_dict(load_plan(run_dir))
    except (OSError, ValueError, KeyError, UserError) as err:
        sys.exit(f"error: cannot read {run_dir / PLAN_FILE} ({err}); pass a run directory "
                 f"written by hybrid-train")
    summary = worker_main(plan_dict, str(run_dir))
    if os.environ["RANK"] == "0":
        losses = summary["losses"]
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
        print(f"run directory: {run_dir}")


if __name__ == "__main__":
    main()
