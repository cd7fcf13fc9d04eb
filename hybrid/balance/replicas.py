"""``parallel.dp_balance=dynamic`` on a rank: the DP replicas' shares of a step's
micro-batches, re-decided from the step times every rank already gathers.

Every rank holds a ``ReplicaShares``. After each step it is fed every rank's compute seconds
and the pipeline part of them (the trainer's one all-gather over the job, the same numbers on
every rank), takes each replica's slowest rank, splits its compute into seconds per
micro-batch and a fixed rest, and at every ``dp_balance_every``-th step (counted from step 0, so a
resumed run decides at the same steps) lets the pure ``hybrid.planning.balance.Balancer``
decide. Same inputs, same pure code: every rank holds the same shares, no extra collective.

With expert parallelism the replicas that share an expert group are one balance unit
(``hybrid.planning.expert_grid.replica_units``): their experts' all-to-all needs each member's
micro-batch, so they run the same count; the units are balanced against each other.

The shares travel in checkpoints (``train.dp_shares``) so a resumed run continues with them.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from hybrid.planning.balance import (
    CHECKPOINT_KEY, Balancer, even_shares, pipeline_bubble, replica_split, share_unit,
)
from hybrid.planning.expert_grid import replica_units
from hybrid.planning.job import JobPlan


class ReplicaShares:
    """The shares every rank agrees on, and this rank's own count."""

    def __init__(self, plan: JobPlan, dp_rank: int, dp_of_rank: Sequence[int]):
        cfg, layout = plan.cfg, plan.layout
        self.plan = plan
        self.dp_rank, self.dp_of_rank = dp_rank, list(dp_of_rank)
        self.even = plan.schedule.microbatches
        """Micro-batches per replica under even shares (what every loss is divided by)."""
        self.unit_of = replica_units(layout, self.dp_of_rank)
        """Per replica, its balance unit (the replicas of one expert group run alike)."""
        units = max(self.unit_of) + 1
        self.dynamic = cfg.parallel.dp_balance == "dynamic" and layout.dp > 1
        self.balancer = Balancer(even_shares(self.even * units, units),
                                 every=cfg.parallel.dp_balance_every,
                                 unit=share_unit(cfg.parallel.schedule, layout.pp),
                                 bubble=pipeline_bubble(layout.pp, layout.vpp),
                                 min_saving=cfg.parallel.dp_balance_min_saving)
        self.warm = False

    @property
    def shares(self) -> tuple[int, ...]:
        """Micro-batches per replica (its unit's)."""
        return tuple(self.balancer.shares[u] for u in self.unit_of)

    @property
    def mine(self) -> int:
        """Micro-batches this rank's replica runs this step."""
        return self.shares[self.dp_rank]

    def of_ranks(self) -> list[int]:
        """Micro-batches each global rank's replica runs this step."""
        shares = self.shares
        return [shares[d] for d in self.dp_of_rank]

    def loader_shares(self) -> Optional[tuple[int, ...]]:
        """What the loader is told (None: even, the loader's own split)."""
        return self.shares if self.dynamic else None

    def after_step(self, step: int, compute_s: Sequence[float], pipeline_s: Sequence[float],
                   *, say: bool) -> None:
        """Feed one step's per-rank compute and the pipeline part of it; decide at every
        ``every``-th step. ``say``: print a line when the shares change (rank 0)."""
        if not self.dynamic:
            return
        if not self.warm:  # the first step of a run (or of a resumed one) builds caches
            self.warm = True
            return
        pipeline, fixed = replica_split(compute_s, pipeline_s,
                                        [self.unit_of[d] for d in self.dp_of_rank],
                                        len(self.balancer.shares))
        before = self.shares
        if self.balancer.observe(pipeline, decide=step % self.balancer.every == 0,
                                 fixed_s=fixed) and say:
            last = self.balancer.last
            print(f"dp_balance: step {step + 1} on, micro-batches per replica "
                  f"{list(before)} -> {list(self.shares)} (predicted step "
                  f"{last.current_s * 1e3:.0f} -> {last.predicted_s * 1e3:.0f} ms)",
                  file=sys.stderr, flush=True)

    def straggler_clause(self, rank: int, ratio: float) -> str:
        """What the straggler warning adds for ``rank`` at ``ratio`` times its peers' compute:
        what balancing would save by the cost model, its replica at ``1 / ratio`` of the
        others' speed (nothing when already balancing, with one replica, or not priceable)."""
        from hybrid.errors import UserError
        from hybrid.planning.cost.devices import device_for
        from hybrid.planning.cost.replicas import replica_prediction, saving_clause

        if self.dynamic or len(self.shares) < 2 or not ratio > 1:
            return ""
        speeds = [1.0] * len(self.shares)
        speeds[self.dp_of_rank[rank]] = round(1 / ratio, 3)
        try:
            p = replica_prediction(self.plan, device_for(self.plan.cfg.cost), speeds)
        except UserError:
            return ""
        return f"; {saving_clause(p)}"

    def record(self) -> dict:
        """This step's ``metrics.jsonl`` fields (only under dynamic)."""
        return {"dp_shares": list(self.shares)} if self.dynamic else {}

    def checkpoint_state(self) -> dict:
        import torch

        return {CHECKPOINT_KEY: torch.tensor(self.shares, dtype=torch.int64)} \
            if self.dynamic else {}

    def checkpoint_targets(self, saved: dict) -> dict:
        """What to load from a checkpoint whose manifest lists ``saved`` tensors: the shares,
        when it has them for as many replicas."""
        import torch

        entry = saved.get(CHECKPOINT_KEY)
        if not self.dynamic or entry is None or list(entry["shape"]) != [len(self.shares)]:
            return {}
        return {CHECKPOINT_KEY: torch.zeros(len(self.shares), dtype=torch.int64)}

    def load_checkpoint_state(self, targets: dict) -> None:
        """Continue with the saved shares (else even, when they do not fit this run)."""
        if CHECKPOINT_KEY in targets:
            saved = targets[CHECKPOINT_KEY].tolist()
            per_unit = {u: saved[d] for d, u in reversed(list(enumerate(self.unit_of)))}
            if all(saved[d] == per_unit[u] for d, u in enumerate(self.unit_of)):
                self.balancer.restore([per_unit[u] for u in sorted(per_unit)])
