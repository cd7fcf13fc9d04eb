"""Lose a node, go on with fewer (``launcher.min_nodes=K`` with ``launcher=torchrun``, or
``launcher=slurm``, where each node's task runs this as ``hybrid-train`` does on torchrun).

The protocol (docs/multinode.md):

1. **One store for the job.** Node 0's ``hybrid-train`` (Slurm: the job's first task) holds
   the rendezvous store at the job's endpoint (``launcher.rdzv_endpoint``; Slurm: the first
   node's free port) for the whole job (torch's static rendezvous shares it: its
   ``TCPStore`` is multi-tenant), so every attempt meets at the same endpoint, each under its
   own run id. Node 0 publishes there the port of its ``Coordinator``
   (``launch/launchers/presence.py``); every other node connects to it and beats.
2. **An attempt** is one elastic launch of the nodes that are in: attempt 0 all
   ``launcher.nnodes``; the workers of attempt ``n`` meet in their own prefix of the store.
3. **When an attempt fails** on a node (its workers lost their peers, or the hang diagnosis
   stopped them), that node reports it to node 0 and waits for its word. Node 0 waits until
   every other node has reported or is gone (it said bye: exit; its connection closed without
   a word: a signal; not heard for ``launcher.silence_timeout_s``: silence). Nobody gone: the
   failure is the job's, and every node ends with it as before. Fewer than ``min_nodes`` left:
   the job ends, in one line.
4. **Re-plan.** Node 0 plans the composed config for the survivors
   (``hybrid.planning.elastic.replan``: the same global batch, more micro-batches per
   replica), writes ``attempt-<n>/plan.json`` in its run directory, takes the newest complete
   checkpoint, and tells each survivor its new node rank (in the order of the old ones) and
   that checkpoint. Each node plans the same (the function is pure) and launches again; the
   ranks load the checkpoint resharded onto the new layout.

5. **A node that comes back** (its ``hybrid-train`` started again, or a replacement with the
   same ``node_rank``) connects and waits. Node 0 sets a key in the running attempt's store;
   the workers read it at their next checkpoint, stop there together, and node 0 re-plans
   for the nodes now there (up to ``launcher.nnodes``) as in 4.
6. **A node counted gone** is told so and hung up on: one that was only stopped (SIGSTOP)
   and continues later ends in one line instead of rejoining with a stale view.

Limits: node 0 must survive (it hosts the store and decides); the nodes must share
``checkpoint.dir``. On Slurm the job is submitted with ``--no-kill`` (``launch.launchers.slurm``)
and a lost node's task never comes back within the job.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

from hybrid.planning.elastic import layout_text, replan
from hybrid.planning.job import RUN_FIELDS, JobPlan
from hybrid.planning.plan_file import save_plan
from launch.launchers.failures import LaunchFailed, WorkerFailure
from launch.launchers.presence import Coordinator, Member
from launch.launchers.rendezvous import Rendezvous, wait_for_node0

COORDINATOR_KEY = "hybrid/elastic/coordinator"


def attempt_dir(run_dir: Path, attempt: int) -> Path:
    """Where attempt ``n``'s plan is written (attempt 0's is the run's own ``plan.json``)."""
    return run_dir if attempt == 0 else run_dir / f"attempt-{attempt}"


@contextlib.contextmanager
def job_channel(cfg, meeting: Rendezvous) -> Iterator[Coordinator | Member]:
    """Node 0: the job's store and the coordinator; other nodes: their line to it.
    ``meeting``: where attempt 0's nodes meet (the launcher's rendezvous)."""
    from torch.distributed import TCPStore

    launcher = cfg.launcher
    host, _, port = meeting.endpoint.rpartition(":")
    timeout = datetime.timedelta(seconds=meeting.timeout_s)
    if meeting.node_rank == 0:
        store = TCPStore(host, int(port), None, True, timeout, wait_for_workers=False,
                         multi_tenant=True)
        coordinator = Coordinator(
            launcher.silence_timeout_s, meeting.nnodes,
            on_join=lambda node: _ask_relayout(cfg, meeting.endpoint, coordinator, node))
        store.set(COORDINATOR_KEY, str(coordinator.port))
        try:
            yield coordinator
        finally:
            coordinator.close()
            del store
        return
    wait_for_node0(meeting)
    store = TCPStore(host, int(port), None, False, timeout, wait_for_workers=False)
    member = Member(host, int(store.get(COORDINATOR_KEY)), meeting.node_rank,
                    meeting.timeout_s)
    del store
    outcome = "killed by an exception"
    try:
        yield member
        outcome = "finished"
    except SystemExit as err:
        outcome = f"exit code {err.code}"
        raise
    except BaseException as err:
        outcome = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        raise
    finally:
        member.close(outcome)


def _ask_relayout(cfg, endpoint: str, coordinator: Coordinator, node: int) -> None:
    """A node came (back) while the job runs on fewer: ask the running workers to stop at
    their next checkpoint (``hybrid.balance.relayout.RELAYOUT_KEY``), when there is room for it."""
    from torch.distributed import TCPStore

    from hybrid.balance.relayout import RELAYOUT_KEY
    from hybrid.worker import store_prefix

    launcher = cfg.launcher
    if len(coordinator.members) >= launcher.nnodes:
        return
    say(f"node {node} is here again: it is taken in at the next checkpoint")
    host, _, port = endpoint.rpartition(":")
    store = TCPStore(host, int(port), None, False,
                     datetime.timedelta(seconds=launcher.rdzv_timeout_s), wait_for_workers=False)
    for restart in range(launcher.max_restarts + 1):
        store.set(f"{store_prefix(coordinator.attempt, restart)}/{RELAYOUT_KEY}", "1")


def plan_for_attempt(composed: JobPlan, nodes: int, node_rank: int,
                     resume_from: Optional[str]) -> JobPlan:
    """The composed plan's config re-planned for ``nodes`` nodes, with the run's own fields
    (checkpoints, data) and the checkpoint it resumes from."""
    fresh = replan(composed.cfg, nodes, composed.ranks_per_node, node_rank)
    kept = {name: getattr(composed, name) for name in RUN_FIELDS if name != "ranks_per_node"}
    return replace(fresh, **{**kept, "resume_from": resume_from})


def newest_checkpoint(plan: JobPlan) -> tuple[Optional[str], int]:
    """(the newest complete checkpoint of the run, its step), or (None, 0)."""
    from hybrid.checkpoint.store import read_manifest, resolve_resume

    path = resolve_resume("auto", Path(plan.checkpoint_dir))
    return (None, 0) if path is None else (str(path), int(read_manifest(path)["step"]))


def predicted_step_s(plan: JobPlan) -> Optional[float]:
    from hybrid.errors import UserError
    from hybrid.planning.cost.devices import device_for
    from hybrid.planning.cost.steptime import predict_step

    try:
        return predict_step(plan, device_for(plan.cfg.cost)).step_time_s
    except UserError:  # a device file it cannot read: the line goes without the prediction
        return None


def say(line: str) -> None:
    print(f"elastic: {line}", file=sys.stderr, flush=True)


def regroup_on_node0(coordinator: Coordinator, composed: JobPlan, current: JobPlan,
                     members: list[int], attempt: int, failure: Optional[str],
                     run_dir: Path) -> Optional[tuple[JobPlan, list[int]]]:
    """Node 0 after ``attempt`` ended (``failure``: its line; None: stopped at a checkpoint
    to take nodes in): who is left and who came, the new plan, told to every node of it.
    None: a failure with nobody gone is the job's own (every node is told to end)."""
    cfg = composed.cfg
    started = time.monotonic()
    wait_s = cfg.train.collective_timeout_s + 2 * cfg.launcher.silence_timeout_s
    ready, gone = coordinator.regroup(attempt, [n for n in members if n != 0], wait_s)
    joining = coordinator.take_joining(cfg.launcher.nnodes - 1 - len(ready))
    if failure is not None and not gone:
        for node in ready:
            coordinator.tell(node, {"end": failure})
        return None
    if failure is not None:
        say(f"attempt {attempt} ended: {failure}")
    for node, why in sorted(gone.items()):
        print(f"warning: node {node} left: {why}", file=sys.stderr, flush=True)
        coordinator.send_away(node, f"node 0 counted this node gone at the end of attempt "
                                    f"{attempt} ({why}) and went on without it; start it "
                                    f"again to be taken back at a checkpoint")
    nodes = [0, *sorted(ready + joining)]
    if len(nodes) < cfg.launcher.min_nodes:
        for node in ready:
            coordinator.tell(node, {"end": "too few nodes left"})
        raise LaunchFailed(f"{len(nodes)} node(s) left, fewer than launcher.min_nodes="
                           f"{cfg.launcher.min_nodes}: {failure}")
    resume, step = newest_checkpoint(composed)
    new = plan_for_attempt(composed, len(nodes), 0, resume)
    attempt_dir(run_dir, attempt + 1).mkdir(parents=True, exist_ok=True)
    save_plan(new, attempt_dir(run_dir, attempt + 1))
    for rank, node in enumerate(nodes[1:], start=1):
        coordinator.tell(node, {"attempt": attempt + 1, "nodes": len(nodes),
                                "node_rank": rank, "resume_from": resume})
    _say_relayout(current, new, nodes, attempt + 1, run_dir, resume, step,
                  time.monotonic() - started)
    return new, nodes


def _say_relayout(current: JobPlan, new: JobPlan, nodes: list[int], attempt: int,
                  run_dir: Path, resume: Optional[str], step: int, took_s: float) -> None:
    """The new layout, the checkpoint it resumes from and what the change costs."""
    say(f"attempt {attempt}: nodes {nodes} go on as {layout_text(new)} (was "
        f"{layout_text(current)}); plan: {attempt_dir(run_dir, attempt) / 'plan.json'}")
    say(f"resuming from {resume} (step {step})" if resume else
        "no complete checkpoint yet: starting again from step 0")
    before, after = predicted_step_s(current), predicted_step_s(new)
    cost = "" if before is None or after is None else \
        f"; predicted step time {before:.4g}s -> {after:.4g}s (x{after / before:.2f})"
    lost = current.world_size - new.world_size
    ranks = f"{lost} of {current.world_size} ranks lost" if lost >= 0 else \
        f"{-lost} ranks gained ({current.world_size} -> {new.world_size})"
    say(f"cost: {ranks}{cost}; regrouped in {took_s:.1f}s")


def _plan_of_word(word: dict, composed: JobPlan) -> JobPlan:
    if word["attempt"] == 0:
        return composed
    say(f"attempt {word['attempt']}: this node goes on as node {word['node_rank']} of "
        f"{word['nodes']}")
    return plan_for_attempt(composed, int(word["nodes"]), int(word["node_rank"]),
                            word.get("resume_from"))


def _attempt(current: JobPlan, run_dir: Path, launcher, attempt: int
             ) -> tuple[Optional[list], Optional[BaseException], Optional[str]]:
    """(results, None, None) when the attempt finished or stopped at a checkpoint for a new
    layout; (None, the error, why it ended: one line in hybrid's words) when it failed."""
    from launch.launchers.attempt_end import attempt_end_reason
    from launch.launchers.run import launch

    started = time.time()
    try:
        return launch(current, run_dir, launcher, attempt=attempt), None, None
    except (WorkerFailure, LaunchFailed) as err:
        return None, err, attempt_end_reason(err, run_dir, started)


def _guarded_attempt(coordinator: Coordinator, current: JobPlan, members: list[int],
                     run_dir: Path, launcher, attempt: int, endpoint: str):
    """Node 0's ``_attempt``, ended at once when a member falls silent
    (``launch.launchers.silence``); the line then names that node."""
    from launch.launchers.attempt_end import keep_raw_text
    from launch.launchers.silence import SilenceGuard, local_rank_stopper

    stop_ranks = local_rank_stopper(endpoint, current, attempt)
    with SilenceGuard(coordinator, attempt, members, stop_ranks) as guard:
        results, error, line = _attempt(current, run_dir, launcher, attempt)
    if error is not None:
        line = (guard.reason or line) + keep_raw_text(run_dir, attempt, line, error)
    return results, error, line


def stopped_for_relayout(results: Optional[list]) -> bool:
    return bool(results) and results[0].get("relayout_at") is not None


def _run_node0(coordinator: Coordinator, plan: JobPlan, run_dir: Path, launcher,
               endpoint: str) -> list:
    attempt, current, members = 0, plan, list(range(plan.cfg.launcher.nnodes))
    while True:
        coordinator.begin(attempt, members)
        results, error, line = _guarded_attempt(coordinator, current, members, run_dir,
                                                launcher, attempt, endpoint)
        if error is None and not stopped_for_relayout(results):
            return results
        going_on = regroup_on_node0(coordinator, plan, current, members, attempt, line,
                                    run_dir)
        if going_on is None:
            raise error
        current, members = going_on
        attempt += 1


def _run_member(member: Member, plan: JobPlan, run_dir: Path, launcher) -> list:
    cfg = plan.cfg
    wait_s = cfg.train.collective_timeout_s + 4 * cfg.launcher.silence_timeout_s
    word = member.word(None)  # a node that comes back waits for the next checkpoint
    while True:
        if "attempt" not in word:
            raise LaunchFailed(word["end"] if word.get("away") else
                               f"node 0 ended the job without this node: {word['end']}")
        attempt = int(word["attempt"])
        results, error, line = _attempt(_plan_of_word(word, plan), run_dir, launcher, attempt)
        if error is None and not stopped_for_relayout(results):
            return results
        word = member.report_end(attempt, line or "stopped at a checkpoint for a new layout",
                                 wait_s)
        if "attempt" not in word and error is not None and not word.get("away"):
            raise error


def run_elastic(plan: JobPlan, run_dir: Path, launcher) -> Optional[list]:
    """Launch ``plan`` and go on with the nodes there are: fewer after nodes left, more at
    the next checkpoint after one came back (module docstring). Raises what the last attempt
    raised when the job cannot go on."""
    if not launcher.runs_here:  # it submits the job: each node runs this (slurm_node.run_node)
        from launch.launchers.run import launch

        return launch(plan, run_dir, launcher)
    meeting = launcher.rendezvous(plan.cfg)
    with job_channel(plan.cfg, meeting) as channel:
        if isinstance(channel, Coordinator):
            return _run_node0(channel, plan, run_dir, launcher, meeting.endpoint)
        return _run_member(channel, plan, run_dir, launcher)
