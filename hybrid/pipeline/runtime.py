"""The pipeline runtime: one interpreter that runs any schedule's actions for this rank.

Per training step every pipeline rank calls ``run_pipeline_step`` with its own action list
(lowered, i.e. with SEND/RECV, or compute-only, then lowered here), its stage modules and the
step's micro-batches. What the interpreter keeps between a micro-batch's forward and its
backward is only what the backward needs:

- the stage input (a leaf that requires grad, so that its gradient can be sent back) and the
  autograd edge of the stage output, not the output tensor: a sent activation is referenced
  only by its in-flight send and freed once the peer has it (see ``p2p.SendsInFlight``);
- for ``I``/``W``: after ``I`` only the branch nodes of the graph and their gradients
  (``backward.WeightGradients``).

Mixed precision: wrap the call in ``torch.autocast``; forwards run under it, backwards not.

Loss scaling: the last stage backpropagates ``loss_fn(output, labels) / m`` per micro-batch,
so the accumulated gradients are those of the mean loss over the ``m`` equal micro-batches,
exactly the 1-process model's mean over the whole batch. Gradients accumulate into ``.grad``
through autograd, once per parameter and micro-batch (in ``W`` for split backwards); no
data-parallel flag is touched here.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from hybrid.groups import ParallelGroups
from hybrid.pipeline import p2p
from hybrid.planning.schedules.actions import (
    BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, LOOP, RECV_B, RECV_F, SEND_B, SEND_F,
    UNSHARD, Action, ScheduleError, stage_rank,
)
from hybrid.planning.schedules.gathers import needs_weights, unshard_directions
from hybrid.pipeline.backward import full_backward, input_backward
from hybrid.planning.schedules.rank_check import Posting, RankPlan, plan_rank

if TYPE_CHECKING:
    from hybrid.dp.zero3 import StageWeights

Microbatch = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]  # (tokens, labels)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# A gloo send waits for the receiver to post its RECV before moving the data, which costs
# about one extra round trip per message (a 256 KB ping-pong: ~3.7 ms with receives posted
# late, ~0.8 ms posted early, on one machine). So on gloo each RECV is posted this many compute
# actions before the one that consumes it; posting a receive never blocks, so this cannot
# deadlock. NCCL runs p2p ops in order on one stream, where an early RECV could hold back a
# SEND: there the list's order holds.
GLOO_RECV_LOOKAHEAD = 2


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
                      placement: str = LOOP, forward_only: bool = False,
                      weights: Optional[StageWeights] = None) -> Optional[float]:
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

    Returns the mean of the micro-batch losses on the rank holding the last stage, else None.
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
    step = _Step(chunks, microbatches, groups=groups, pp=pp, vpp=vpp, placement=placement,
                 loss_fn=loss_fn,
                 act_shape=tuple(act_shape), act_dtype=act_dtype, recorder=recorder,
                 recv_timeout_s=recv_timeout_s, progress=progress, forward_only=forward_only,
                 weights=weights)
    with torch.no_grad() if forward_only else torch.enable_grad():
        return step.run(plan.posting)


def prepare_rank(actions: Sequence[Action], chunks: dict[int, nn.Module], *,
                 groups: ParallelGroups, pp: int, vpp: int, m: int, placement: str = LOOP,
                 forward_only: bool = False) -> RankPlan:
    """This rank's ``RankPlan`` for ``run_pipeline_step``: ``actions`` lowered, checked
    against the stages in ``chunks``, and their messages planned for the PP group's backend."""
    if placement != LOOP and pp > 1 and groups.pipeline.backend != "gloo":
        raise ScheduleError(f"the {placement} placement's messages are matched by tag, which "
                            f"only gloo does; use a loop-placed schedule (zb-h1) on "
                            f"{groups.pipeline.backend}")
    return plan_rank(actions, sorted(chunks), rank=groups.pp_rank, pp=pp, vpp=vpp, m=m,
                     placement=placement, recv_lookahead=recv_lookahead(groups),
                     forward_only=forward_only)


def recv_lookahead(groups: ParallelGroups) -> int:
    return GLOO_RECV_LOOKAHEAD if groups.pipeline.backend == "gloo" else 0


class _Step:
    """The state of one step on one rank, keyed by (stage, micro-batch)."""

    def __init__(self, chunks, microbatches, *, groups, pp, vpp, placement, loss_fn, act_shape,
                 act_dtype, recorder, recv_timeout_s, progress, forward_only=False,
                 weights=None):
        self.chunks, self.microbatches, self.groups = chunks, microbatches, groups
        self.pp, self.m, self.last_stage = pp, len(microbatches), pp * vpp - 1
        self.placement = placement
        self.loss_fn, self.act_shape, self.act_dtype = loss_fn, act_shape, act_dtype
        self.recorder, self.progress = recorder, progress
        self.timeout = None if recv_timeout_s is None else timedelta(seconds=recv_timeout_s)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}  # stage inputs (leaves)
        self.roots: dict = {}  # output edge, or the loss on the last stage
        self.local_grads: dict[tuple[int, int], torch.Tensor] = {}  # same-rank hand-over
        self.outbox: dict[Action, torch.Tensor] = {}  # made by compute, taken by SEND
        self.pending: dict[Action, p2p.PendingRecv] = {}  # RECVs posted, not yet waited on
        self.arrived: dict[Action, torch.Tensor] = {}  # RECVs waited on, not yet consumed
        self.deferred: dict[tuple[int, int], Callable[[], None]] = {}  # W work left by I
        self.losses: list[torch.Tensor] = []
        self.sends = p2p.SendsInFlight(threaded=groups.pipeline.backend == "gloo")
        self.forward_only = forward_only
        self.weights = weights

    def run(self, posting: Sequence[Posting]) -> Optional[float]:
        compute = {FORWARD: self.forward, BACKWARD: self.backward,
                   BACKWARD_INPUT: self.input_backward, BACKWARD_WEIGHT: self.weight_backward}
        self.directions = iter(unshard_directions([a for _, a in posting if a is not None]))
        try:
            for posts, action in posting:
                if posts:
                    self.communicate(posts)
                if action is not None and action.is_shard:
                    self._shard(action)
                elif action is not None:
                    self.sends.release_finished()
                    if self.weights is not None and needs_weights(action):
                        self.weights.ready(action.stage)
                    self._wait_inputs(action)  # outside the timed span: a wait is not work
                    start = self._now()
                    self._started(action)
                    with self._precision(action):
                        compute[action.kind](action.stage, action.mb)
                    self._finished(action)
                    self._record(action, start, self._now())
        except BaseException:
            self.sends.abandon()  # a peer may never receive them: do not wait
            raise
        try:
            self.sends.wait_all()
        except BaseException:
            failed = self.sends.failed_label
            if self.progress is not None and failed is not None:
                self.progress.started(failed, self._peer_of(failed))  # say which send
            raise
        left = self.pending or self.arrived or self.outbox or self.deferred or self.roots
        assert not left, "a checked schedule leaves nothing behind"
        if not self.losses:
            return None
        return float(torch.stack(self.losses).sum())

    def _shard(self, action: Action) -> None:
        """A ZeRO-3 gather (started here, waited on by the first compute that needs it) or
        release."""
        if self.weights is None:
            raise ScheduleError(f"{action} needs parallel.zero=3's gathered weights; pass "
                                f"weights=GradSync.stage_weights(chunks)")
        if action.kind == UNSHARD:
            self.weights.unshard(action.stage, next(self.directions))
        else:
            self.weights.reshard(action.stage)

    def _now(self) -> float:
        """Wall-clock time; when recording on CUDA, after the queued kernels have finished
        (only then does a span measure the work, not its launch)."""
        if self.recorder is not None and self.groups.device.type == "cuda":
            torch.cuda.synchronize(self.groups.device)
        return time.time()

    def _precision(self, action: Action):
        """Backwards run outside any autocast region the caller wrapped the step in, as
        torch's autocast asks: each op's backward then uses the dtype its forward chose."""
        if action.kind == FORWARD:
            return contextlib.nullcontext()
        return torch.autocast(self.groups.device.type, enabled=False)

    # ----- communication ---------------------------------------------------------------------
    def communicate(self, batch: list[Action]) -> None:
        payloads = {a: self.outbox.pop(a) for a in batch if a.kind in (SEND_F, SEND_B)}
        sends, recvs = p2p.post(
            batch, payloads, group=self.groups.pipeline, n_microbatches=self.m,
            recv_buffer=self._recv_buffer, placement=self.placement)
        del payloads  # the sends hold the only references now
        for action, tensor, work in sends:
            self.sends.add(work, tensor, label=action)
            self._record(action, time.time(), time.time())
        for pending in recvs:
            self.pending[pending.action] = pending

    def _recv_buffer(self) -> torch.Tensor:
        return torch.empty(self.act_shape, dtype=self.act_dtype, device=self.groups.device)

    def _remote(self, stage: int, neighbour: int) -> bool:
        """Whether the neighbouring stage (``stage +- 1``, in range) runs on another rank."""
        return (stage_rank(stage, self.pp, self.placement)
                != stage_rank(neighbour, self.pp, self.placement))

    def _wait_inputs(self, action: Action) -> None:
        """Wait for the message ``action`` consumes, if any, into ``self.arrived``."""
        stage = action.stage
        if action.kind == FORWARD and stage > 0 and self._remote(stage, stage - 1):
            recv = Action(stage, RECV_F, action.mb)
        elif (action.is_backward_input and stage < self.last_stage
              and self._remote(stage, stage + 1)):
            recv = Action(stage, RECV_B, action.mb)
        else:
            return
        pending, start = self.pending.pop(recv), time.time()
        if self.progress is not None:
            self.progress.started(recv, self._peer_of(recv))
        self.arrived[recv] = p2p.wait_recv(pending, self.timeout, self.groups.pp_rank)
        self._finished(recv)
        self._record(recv, start, time.time())  # the time this rank was blocked on it

    def _peer_of(self, action: Action) -> int:
        """The global rank at the other end of a SEND/RECV action."""
        return self.groups.pipeline.ranks[
            stage_rank(p2p.peer_stage(action), self.pp, self.placement)]

    def _started(self, action: Action) -> None:
        if self.progress is not None:
            self.progress.started(action)

    def _finished(self, action: Action) -> None:
        if self.progress is not None:
            self.progress.finished(action)

    def _record(self, action: Action, start: float, end: float) -> None:
        if self.recorder is not None:
            self.recorder.record(action, start, end)

    # ----- compute ---------------------------------------------------------------------------
    def forward(self, stage: int, mb: int) -> None:
        if self.forward_only:
            self._evaluate(stage, mb)
            return
        tokens, labels = self.microbatches[mb]
        if stage == 0:
            stage_input = tokens
        elif not self._remote(stage, stage - 1):
            stage_input = self.inputs[(stage, mb)]  # handed over by the previous chunk
        else:
            stage_input = self.arrived.pop(Action(stage, RECV_F, mb)).requires_grad_()
            self.inputs[(stage, mb)] = stage_input
        output = self.chunks[stage](stage_input)
        if stage == self.last_stage:
            loss = self.loss_fn(output, labels) / self.m
            self.losses.append(loss.detach())
            self.roots[(stage, mb)] = loss
            return
        self._check_activation(stage, output)
        self.roots[(stage, mb)] = get_gradient_edge(output)
        if not self._remote(stage, stage + 1):
            self.inputs[(stage + 1, mb)] = output.detach().requires_grad_()
        else:
            self.outbox[Action(stage, SEND_F, mb)] = output.detach()

    def _evaluate(self, stage: int, mb: int) -> None:
        """A forward that keeps nothing for a backward: the loss, or the output handed on."""
        tokens, labels = self.microbatches[mb]
        if stage == 0:
            stage_input = tokens
        elif not self._remote(stage, stage - 1):
            stage_input = self.inputs.pop((stage, mb))
        else:
            stage_input = self.arrived.pop(Action(stage, RECV_F, mb))
        output = self.chunks[stage](stage_input)
        if stage == self.last_stage:
            self.losses.append(self.loss_fn(output, labels) / self.m)
            return
        self._check_activation(stage, output)
        if not self._remote(stage, stage + 1):
            self.inputs[(stage + 1, mb)] = output
        else:
            self.outbox[Action(stage, SEND_F, mb)] = output

    def backward(self, stage: int, mb: int) -> None:
        root, grad = self.roots.pop((stage, mb)), self._output_grad(stage, mb)
        full_backward(root, grad)
        if stage > 0:
            self._hand_back(stage, mb, self.inputs.pop((stage, mb)).grad)

    def input_backward(self, stage: int, mb: int) -> None:
        root, grad = self.roots.pop((stage, mb)), self._output_grad(stage, mb)
        if stage == 0:  # no input gradient to make: the whole backward waits for W
            self.deferred[(stage, mb)] = lambda: full_backward(root, grad)
            return
        input_grad, weights = input_backward(root, grad, self.inputs.pop((stage, mb)))
        self.deferred[(stage, mb)] = weights.run
        self._hand_back(stage, mb, input_grad)

    def weight_backward(self, stage: int, mb: int) -> None:
        self.deferred.pop((stage, mb))()

    def _output_grad(self, stage: int, mb: int) -> Optional[torch.Tensor]:
        if stage == self.last_stage:
            return None  # the root is the loss
        if not self._remote(stage, stage + 1):
            return self.local_grads.pop((stage, mb))
        return self.arrived.pop(Action(stage, RECV_B, mb))

    def _hand_back(self, stage: int, mb: int, input_grad: torch.Tensor) -> None:
        if not self._remote(stage, stage - 1):
            self.local_grads[(stage - 1, mb)] = input_grad
        else:
            self.outbox[Action(stage, SEND_B, mb)] = input_grad

    def _check_activation(self, stage: int, output: torch.Tensor) -> None:
        if tuple(output.shape) != self.act_shape or output.dtype != self.act_dtype:
            raise ValueError(
                f"stage {stage} outputs {list(output.shape)} {output.dtype} but the receive "
                f"buffers are act_shape={list(self.act_shape)} act_dtype={self.act_dtype}; pass "
                f"the shape stages exchange ([s, micro_batch, hidden], s/tp with sequence "
                f"parallelism)")
