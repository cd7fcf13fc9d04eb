"""One step of the pipeline interpreter on one rank (``runtime.run_pipeline_step`` makes it).

What it keeps between a micro-batch's forward and its backward is only what the backward
needs:

- the stage input (a leaf that requires grad, so that its gradient can be sent back) and the
  autograd edge of the stage output, not the output tensor: a sent activation is referenced
  only by its in-flight send and freed once the peer has it (see ``p2p.SendsInFlight``);
- for ``I``/``W``: after ``I`` only the branch nodes of the graph and their gradients
  (``backward.WeightGradients``).

Under ZeRO-3 the plan's ``UNSHARD``/``RESHARD`` actions go to the ``weights`` object
(``hybrid.dp.zero3.StageWeights``), and a compute that needs its stage's weights checks first
that they may be gathered.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
from torch.autograd.graph import get_gradient_edge

from hybrid.pipeline import p2p
from hybrid.pipeline.backward import full_backward, input_backward
from hybrid.planning.schedules.actions import (
    BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F,
    EXTRA_KINDS, UNSHARD, Action, ScheduleError, stage_rank,
)
from hybrid.planning.schedules.gathers import needs_weights
from hybrid.planning.schedules.rank_check import RankPlan


class Step:
    """The state of one step on one rank, keyed by (stage, micro-batch)."""

    def __init__(self, chunks, microbatches, *, groups, pp, vpp, placement, loss_fn, act_shape,
                 act_dtype, recorder, recv_timeout_s, progress, forward_only=False,
                 weights=None, loss_divisor=None):
        self.chunks, self.microbatches, self.groups = chunks, microbatches, groups
        self.pp, self.m, self.last_stage = pp, len(microbatches), pp * vpp - 1
        self.loss_divisor = self.m if loss_divisor is None else loss_divisor
        """What each micro-batch's loss is divided by: ``m``, or under unequal DP shares the
        even count, so a replica's gradient weighs by the micro-batches it ran."""
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
        self.sends = p2p.SendsInFlight(threaded=groups.pipeline.transport.threaded_sends)
        self.forward_only = forward_only
        self.weights = weights

    def run(self, plan: RankPlan) -> Optional[float]:
        """Run ``plan``'s actions in order; the mean loss on the last stage's rank."""
        compute = {FORWARD: self.forward, BACKWARD: self.backward,
                   BACKWARD_INPUT: self.input_backward, BACKWARD_WEIGHT: self.weight_backward}
        self.directions = iter(plan.unshard_directions)
        try:
            for posts, action in plan.posting:
                if posts:
                    self.communicate(posts)
                if action is not None and action.is_shard:
                    self._shard(action)
                elif action is not None and action.is_extra:
                    self._extra(action)
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

    @staticmethod
    def _extra(action: Action) -> None:
        """A registered kind's action (``actions.register_action_kind``): its ``run``."""
        run = EXTRA_KINDS[action.kind].run
        if run is not None:
            run(action.stage, action.mb)

    def _now(self) -> float:
        """Wall-clock time; when recording, after the transport's queued work has finished
        (on CUDA only then does a span measure the work, not its launch)."""
        if self.recorder is not None:
            self.groups.pipeline.transport.settle(self.groups.device)
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
            loss = self.loss_fn(output, labels) / self.loss_divisor
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
            self.losses.append(self.loss_fn(output, labels) / self.loss_divisor)
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
