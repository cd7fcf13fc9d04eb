"""``parallel.pp_balance=dynamic`` on a rank: the pipeline stages' layer split, re-decided
from the step times every rank already gathers, and the state moved to a new split.

Every rank holds a ``StageSplit``. After each step it is fed every rank's pipeline seconds
(the forward and backward, waits excluded: the trainer's one all-gather over the job, the
same numbers on every rank), takes each stage's slowest rank per micro-batch, and at every
``pp_balance_every``-th step (counted from step 0, so a resumed run decides at the same
steps) lets the pure ``hybrid.planning.stage_balance.StageBalancer`` decide. Same inputs,
same pure code: every rank holds the same split, no extra collective. The split is the same
in every DP replica.

A new split is applied at the step boundary (``move_state``), by ``parallel.pp_balance_move``:

- ``memory`` (the default): every rank builds its stages for the new split and the layers
  that changed stage travel between the ranks of each pipeline as point-to-point messages
  (weights, AdamW moments and step, DP option state, expert biases;
  ``hybrid.balance.stage_move``). No disk, and only the moved layers travel:
  ``bench/pp_move.py`` measures it against the checkpoint.
- ``checkpoint``: every rank writes its state (weights, AdamW moments, RNG, DP shares) to a
  checkpoint of its own in ``<checkpoint dir>/pp_balance``, builds its stages for the new
  split, and loads it back, resharded as a resume on another layout is (DCP, keyed by global
  names). Every rank's RNG is then the one copy DCP kept of ``rng.cpu``; ``memory`` leaves
  each rank's as it was.

State filed under no parameter cannot follow a layer (``dp_delay``'s mean in flight is each
bucket's): ``hybrid.planning.stage_balance`` refuses it with ``dynamic`` before launch.

Either way the same values, only their owners change: the losses are the static split's.

The split travels in every checkpoint's manifest (``stages``), so a resumed run continues
on it (``resumed_plan``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from hybrid.balance.stage_move import move_in_memory
from hybrid.checkpoint.checkpointer import Checkpointer, checkpoints_of, resume_path
from hybrid.checkpoint.store import checkpoint_name, read_manifest
from hybrid.planning.job import JobPlan
from hybrid.planning.stage_balance import StageBalancer, layer_counts, stage_seconds

MOVE_DIR = "pp_balance"
"""Under the checkpoint directory: where a re-split's state passes (removed after)."""


def balance_costs(plan: JobPlan, groups) -> tuple[float, ...]:
    """Per block, the seconds a stage's speed is priced per: the plan's measured block costs
    (``partition=measured``), else the block kinds timed now on every rank as
    ``partition=measured`` times them (a collective: every rank calls it). Not the cost
    model's FLOPs: on a small model the head and the loss cost far more than their FLOPs
    say, and a stage that holds them would look slow per FLOP."""
    if plan.block_costs is not None and plan.costs_measured:
        return tuple(plan.block_costs)
    from hybrid.pipeline.calibrate import agreed_block_seconds

    forwards, backwards = agreed_block_seconds(plan.cfg, groups)
    return tuple(f + b for f, b in zip(forwards, backwards))


class StageSplit:
    """The split every rank agrees on."""

    def __init__(self, plan: JobPlan, groups, pp_of_rank: Sequence[int]):
        cfg = plan.cfg
        self.pp_of_rank = list(pp_of_rank)
        self.dynamic = cfg.parallel.pp_balance == "dynamic" and plan.layout.pp > 1
        costs = balance_costs(plan, groups) if self.dynamic else \
            (1.0,) * (plan.stages[-1].blocks.stop)
        self.balancer = StageBalancer(
            tuple(stage.blocks for stage in plan.stages), costs,
            plan.schedule.microbatches, every=cfg.parallel.pp_balance_every,
            min_saving=cfg.parallel.pp_balance_min_saving)
        self.steps = cfg.train.steps
        self.warm = False
        self.ran = layer_counts(self.balancer.split)
        """Layers per stage in the step last fed (what its record says)."""

    def after_step(self, step: int, pipeline_s: Sequence[float],
                   microbatches_of_rank: Sequence[int], *, say: bool,
                   final: bool = False) -> Optional[list[range]]:
        """Feed one step's per-rank pipeline seconds (and each rank's micro-batches); decide
        at every ``every``-th step but the run's ``final`` one (no step follows to move
        for, and a line announcing a move that never happens would mislead). Returns the
        new split when it changed (from the next step on); ``say``: print one line then
        (rank 0)."""
        if not self.dynamic:
            return None
        self.ran = layer_counts(self.balancer.split)
        if not self.warm:  # the first step of a run (or of a resumed one) builds caches
            self.warm = True
            return None
        balancer = self.balancer
        before = balancer.split
        per_mb = stage_seconds(pipeline_s, self.pp_of_rank, microbatches_of_rank,
                               len(before))
        if not balancer.observe(per_mb, decide=step % balancer.every == 0 and not final,
                                steps_left=self.steps - step):
            return None
        if say:
            last = balancer.last
            measured = [round(ms, 1) for ms in balancer.stage_ms(before)]
            print(f"pp_balance: step {step + 1} on, layers per stage "
                  f"{layer_counts(before)} -> {layer_counts(balancer.split)} (measured stage "
                  f"ms per micro-batch {measured}; predicted step "
                  f"{last.current_s * 1e3:.0f} -> {last.predicted_s * 1e3:.0f} ms)",
                  file=sys.stderr, flush=True)
        return list(balancer.split)

    def record(self) -> dict:
        """This step's ``metrics.jsonl`` fields (only under dynamic)."""
        return {"pp_split": self.ran} if self.dynamic else {}

    def restart_window(self, move_s: float, world) -> None:
        """After a move (which took ``move_s`` seconds on this rank: the next must win back
        twice the slowest rank's, ``StageBalancer.moved``, agreed over ``world`` so that
        every rank decides alike), the next step builds caches again: not measured."""
        took = torch.tensor([move_s], dtype=torch.float64)
        world.all_reduce(took, op=dist.ReduceOp.MAX)
        self.balancer.moved(float(took))
        self.warm = False


def resumed_plan(plan: JobPlan, run_dir: Path) -> JobPlan:
    """Under dynamic: ``plan`` on the split of the checkpoint it resumes from (its manifest's
    ``stages``), when it has one for as many stages; else ``plan``."""
    if plan.cfg.parallel.pp_balance != "dynamic":
        return plan
    path = resume_path(plan, checkpoints_of(plan, run_dir))
    if path is None:
        return plan
    saved = read_manifest(path).get("stages")
    current = [stage.blocks for stage in plan.stages]
    if not saved or len(saved) != len(current) or saved[-1][1] != current[-1].stop:
        return plan
    ranges = [range(first, stop) for first, stop in saved]
    return plan if ranges == current else plan.with_stage_ranges(ranges)


def move_state(old: Checkpointer, rebuild: Callable[[], Checkpointer], step: int,
               how: str = "checkpoint") -> None:
    """Every rank: move the state of ``old``'s stages into those ``rebuild`` builds for the
    new split (returning their checkpointer), in memory or through a checkpoint (``how``:
    ``parallel.pp_balance_move``)."""
    old.close()  # a background save of the run's own finishes first
    stall_s = old.stall_s
    if how == "memory":
        new = move_in_memory(old, rebuild)
    else:
        new = _through_checkpoint(old, rebuild, step)
    # what the run started from, and the stalls its own saves caused, stay the run's
    new.resumed_from, new.initialised_from = old.resumed_from, old.initialised_from
    new.stall_s = stall_s


def _through_checkpoint(old: Checkpointer, rebuild: Callable[[], Checkpointer],
                        step: int) -> Checkpointer:
    """Write the state through ``old`` into ``MOVE_DIR``, rebuild, load it back."""
    directory = old.directory / MOVE_DIR
    old.directory, old.quiet = directory, True
    old.save(step)
    old.close()
    new = rebuild()
    new.load(directory / checkpoint_name(step))
    new.groups.world.barrier()  # every rank has read it
    if new.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return new
