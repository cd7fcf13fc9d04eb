"""The pipeline runtime: one interpreter that runs any schedule's actions for this rank.

Per training step every pipeline rank calls ``run_pipeline_step`` with its own action list
(lowered, i.e. with SEND/RECV, or compute-only, then lowered here), its stage modules and the
step's micro-batches; ``step.Step`` holds the step's state and runs the actions (what it keeps
between a micro-batch's forward and its backward: its module doc).

Mixed precision: wrap the call in ``torch.autocast``; forwards run under it, backwards not.

Loss scaling: the last stage backpropagates ``loss_fn(output, labels) / m`` per micro-batch,
so the accumulated gradients are those of the mean loss over the ``m`` equal micro-batches,
exactly the 1-process model's mean over the whole batch (``loss_divisor`` replaces ``m`` when
DP replicas run unequal shares of the step: ``parallel.dp_balance=dynamic``). Gradients accumulate into ``.grad``
through autograd, once per parameter and micro-batch (in ``W`` for split backwards); no
data-parallel flag is touched here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import torch
from torch import nn

from hybrid.groups import ParallelGroups
from hybrid.pipeline.step import Step
from hybrid.planning.schedules.stage_map import Placement
from hybrid.planning.schedules.actions import LOOP, Action, ScheduleError
from hybrid.planning.schedules.rank_check import RankPlan, plan_rank

if TYPE_CHECKING:
    from hybrid.dp.zero3 import StageWeights

Microbatch = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]  # (tokens, labels)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Recorder(Protocol):
    def record(self, action: Action, start_s: float, end_s: float) -> None: ...


class Progress(Protocol):
    """Told when each action (a RECV wait included) starts and finishes (``RankWatch``)."""

    def started(self, action: Action, peer: Optional[int] = None) -> None:
        """``peer``: for a RECV, the global rank it waits on."""

    def finished(self, action: Action) -> None: ...


def run_pipeline_step(actions: Sequence[Action] | RankPlan, chunks: dict[int, nn.Module],
                      microbatches: Sequence[Microbatch], *, groups: ParallelGroups, pp: int,
                      vpp: int, loss_fn: LossFn, act_shape: Sequence[int],
                      act_dtype: torch.dtype, recorder: Optional[Recorder] = None,
                      recv_timeout_s: Optional[float] = None,
                      progress: Optional[Progress] = None,
                      placement: Placement = LOOP, forward_only: bool = False,
                      weights: Optional[StageWeights] = None,
                      loss_divisor: Optional[int] = None) -> Optional[float]:
    """Run one step's forwards and backwards of this rank's stages; return the mean loss.

    ``actions``: a ``RankPlan`` from ``prepare_rank`` (checked once; what a trainer passes
    every step), or this rank's list of a schedule (``add_communication(build_schedule(...),
    pp, vpp, placement)[groups.pp_rank]``). ``chunks``: virtual stage id -> module (stage
    ``s`` lives on pipeline rank ``stage_rank(s, pp, placement)``; neighbouring stages on one
    rank hand over in memory). ``microbatches``: ``m`` pairs (tokens ``[b, s]``, labels
    ``[b, s]``); tokens are read on the rank of stage 0, labels on the rank of the last stage,
    elsewhere they may be None. ``act_shape``/``act_dtype``: the activation passed between
    stages (``[s, b, h]``, ``[s/tp, b, h]`` with sequence parallelism), the shape of every
    receive buffer. ``recorder.record(action, start_s, end_s)`` gets the wall-clock span of
    every action. A RECV that waits longer than ``recv_timeout_s`` (default: the process
    group's timeout) raises ``PipelineTimeout``. ``progress`` is told when every action
    starts and finishes, so that a failure can say where each rank was.

    ``forward_only``: evaluation: ``actions`` hold forwards only (``schedules.forward_only``),
    no autograd graph is recorded and nothing is kept for a backward.

    ``weights``: under ZeRO-3, what runs the list's ``UNSHARD``/``RESHARD`` actions
    (``GradSync.stage_weights``); a compute that needs its stage's weights waits for their
    gather first (``schedules.gathers.needs_weights``).

    ``loss_divisor``: what each micro-batch's loss is divided by (default ``m``: the mean).
    Under ``parallel.dp_balance=dynamic`` a replica running ``m_r`` of the step's ``M``
    micro-batches divides by the even count ``M / dp``, so that after the DP mean (which
    divides by ``dp``) its gradient weighs ``m_r / M``: by the tokens it processed.

    Returns the sum of the micro-batch losses over ``loss_divisor`` (the mean, by default) on
    the rank holding the last stage, else None.
    Every send has completed when it returns.
    """
    m = len(microbatches)
    if isinstance(actions, RankPlan):
        plan = actions
        plan.check_made_for(rank=groups.pp_rank, pp=pp, vpp=vpp, m=m, placement=placement,
                            stages=chunks, recv_lookahead=recv_lookahead(groups),
                            forward_only=forward_only)
    else:
        plan = prepare_rank(actions, chunks, groups=groups, pp=pp, vpp=vpp, m=m,
                            placement=placement, forward_only=forward_only)
    step = Step(chunks, microbatches, groups=groups, pp=pp, vpp=vpp, placement=placement,
                 loss_fn=loss_fn,
                 act_shape=tuple(act_shape), act_dtype=act_dtype, recorder=recorder,
                 recv_timeout_s=recv_timeout_s, progress=progress, forward_only=forward_only,
                 weights=weights, loss_divisor=loss_divisor)
    with torch.no_grad() if forward_only else torch.enable_grad():
        return step.run(plan)


def prepare_rank(actions: Sequence[Action], chunks: dict[int, nn.Module], *,
                 groups: ParallelGroups, pp: int, vpp: int, m: int, placement: Placement = LOOP,
                 forward_only: bool = False) -> RankPlan:
    """This rank's ``RankPlan`` for ``run_pipeline_step``: ``actions`` lowered, checked
    against the stages in ``chunks``, and their messages planned for the PP group's backend."""
    transport = groups.pipeline.transport
    if placement != LOOP and pp > 1 and not transport.matches_tags:
        raise ScheduleError(f"the {placement} placement's messages are matched by tag, which "
                            f"{transport.backend} does not do (it runs them in the order "
                            f"issued); use a loop-placed schedule (zb-h1) on {transport.backend}")
    return plan_rank(actions, sorted(chunks), rank=groups.pp_rank, pp=pp, vpp=vpp, m=m,
                     placement=placement, recv_lookahead=recv_lookahead(groups),
                     forward_only=forward_only)


def recv_lookahead(groups: ParallelGroups) -> int:
    """How many compute actions early this rank posts each RECV (``hybrid.transport``)."""
    return groups.pipeline.transport.recv_lookahead
