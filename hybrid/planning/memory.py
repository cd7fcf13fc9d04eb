"""Will the job fit in memory? The estimate per rank against what the ranks can use (pure).

On CPU the ranks of a node share its host memory, so their estimates add up (plus what each
worker process holds just by running torch and megatron-core); on CUDA each rank has its
device. ``check_memory`` raises ``LayoutError`` naming the rank, the estimate, the limit and
the first change that would fit; ``hybrid-train`` calls it before launch unless
``train.skip_memory_check=true``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from hybrid.errors import UserError
from hybrid.planning.config import Config
from hybrid.planning.cost.sizes import human_bytes
from hybrid.planning.layout import LayoutError
from hybrid.planning.job import JobPlan, plan_job
from hybrid.planning.strategies import SHARDINGS

RUNTIME_BYTES_PER_PROCESS = 256 * 2**20
"""A worker's own footprint before any model: torch, megatron-core and gloo resident (this
project's workers measure 330-370 MiB peak RSS with the tiny model, shared libraries
counted in each)."""


@dataclass(frozen=True)
class MemoryNeed:
    rank: int
    """The rank with the largest estimate."""
    rank_bytes: int
    """That rank's estimate: weights, gradients, optimizer state, activations."""
    needed_bytes: int
    """What must fit in the limit: on CPU the sum over the ranks of one node plus each
    worker's runtime footprint; on CUDA the largest rank's estimate."""


def memory_need(cfg: Config, device: str) -> MemoryNeed:
    """The need of ``cfg`` planned in closed form (no simulation: the suggestions price many)."""
    return plan_need(plan_job(cfg, simulated=False), device)


def plan_need(plan: JobPlan, device: str) -> MemoryNeed:
    """The need of a job already planned."""
    per_rank = [plan.memory_of(rank).total_bytes for rank in range(plan.world_size)]
    worst = max(range(len(per_rank)), key=per_rank.__getitem__)
    if device != "cpu":  # each rank has a device of its own
        return MemoryNeed(worst, per_rank[worst], per_rank[worst])
    per_node = plan.ranks_per_node
    node_totals = [sum(per_rank[i:i + per_node]) + per_node * RUNTIME_BYTES_PER_PROCESS
                   for i in range(0, len(per_rank), per_node)]
    return MemoryNeed(worst, per_rank[worst], max(node_totals))


def _candidates(cfg: Config) -> list[tuple[str, Config]]:
    """Single changes that shrink the need, cheapest in speed first."""
    out = []

    def variant(label: str, section: str, key: str, value) -> None:
        changed = copy.deepcopy(cfg)
        setattr(getattr(changed, section), key, value)
        out.append((label, changed))

    if cfg.parallel.dp * cfg.parallel.cp > 1:  # each further ZeRO stage the registry has
        for stage in sorted(s for s, spec in SHARDINGS.items()
                            if s > cfg.parallel.zero and spec.searched):
            variant(f"parallel.zero={stage}", "parallel", "zero", stage)
    if cfg.model.recompute != "full":
        variant("model.recompute=full", "model", "recompute", "full")
    if cfg.train.precision == "fp32":
        variant("train.precision=bf16", "train", "precision", "bf16")
    for axis in ("tp", "pp"):
        size = getattr(cfg.parallel, axis) * 2
        variant(f"parallel.{axis}={size}", "parallel", axis, size)
    return out


def suggestion(cfg: Config, limit: int, device: str) -> Optional[str]:
    """The first change (one override, else two) after which the job fits, with its need."""
    singles = _candidates(cfg)
    pairs = [(f"{label} {label2}", changed2) for label, changed in singles
             for label2, changed2 in _candidates(changed)
             if label2 > label and label2.split("=")[0] != label.split("=")[0]]
    for label, changed in singles + pairs:
        try:
            need = memory_need(changed, device)
        except UserError:
            continue  # that change is not a valid layout for this model
        if need.needed_bytes <= limit:
            return f"{label} would need {human_bytes(need.needed_bytes)}"
    return None


def memory_verdict(cfg: Config, limit: int, device: str) -> dict:
    """What ``hybrid-plan`` reports: need, limit, whether it fits, and one line saying so."""
    need = memory_need(cfg, device)
    fits = need.needed_bytes <= limit
    line = (f"fits: needs about {human_bytes(need.needed_bytes)} of {human_bytes(limit)} "
            f"({device})" if fits else _too_big(cfg, need, limit, device))
    return {"needed_bytes": need.needed_bytes, "limit_bytes": limit, "device": device,
            "fits": fits, "line": line}


def check_memory(plan: JobPlan, limit: int, device: str) -> None:
    """Raise ``LayoutError`` when the planned job's estimate exceeds ``limit`` bytes (the plan
    itself: the config is not planned, nor validated, again)."""
    need = plan_need(plan, device)
    if need.needed_bytes > limit:
        raise LayoutError(_too_big(plan.cfg, need, limit, device))


def _too_big(cfg: Config, need: MemoryNeed, limit: int, device: str) -> str:
    where = ("host memory available to the ranks of one node" if device == "cpu"
             else f"memory of one {device} device")
    fix = suggestion(cfg, limit, device) or "no change of zero, recompute, precision, tp or " \
                                            "pp (one or two) fits: use a smaller model"
    return (
        f"the job needs about {human_bytes(need.needed_bytes)} (rank {need.rank}: "
        f"{human_bytes(need.rank_bytes)} of weights, gradients, optimizer state and "
        f"activations) but the {where} is {human_bytes(limit)}; {fix} "
        f"(or skip this check with train.skip_memory_check=true)")
