"""Point-to-point traffic of the pipeline runtime: one message per SEND/RECV action, inside the
PP group only.

Matching. Every message carries a tag naming (sending stage, direction, micro-batch), so gloo,
which matches on (peer, tag), pairs each RECV with its SEND whatever order the two ranks post
them in; a neighbour pair can carry activations one way and gradients the other way, and with
interleaving two streams of activations. NCCL ignores tags and matches a pair's messages in
posting order; ``fifo_mismatches`` says whether a schedule's lists keep that order.

Completion. A gloo send completes only when the peer has received it, and its ``Work`` says so
only from inside ``wait()`` (``is_completed()`` stays False until then). A send whose buffer we
want back must therefore be waited on, but waiting in the interpreter would block it on a peer
that may be waiting on us. ``SendsInFlight`` waits in one background thread instead (``wait``
releases the GIL), so a sent activation is freed as soon as the peer has it; on backends whose
``is_completed()`` is live (NCCL) finished sends are simply polled.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from hybrid.comm import RECV, SEND, Group, Message
from hybrid.planning.schedules.stage_map import Placement
from hybrid.planning.schedules.actions import LOOP, RECV_B, RECV_F, SEND_B, SEND_F, Action, stage_rank

FORWARD_DIRECTION, BACKWARD_DIRECTION = 0, 1


class PipelineTimeout(RuntimeError):
    """A RECV waited longer than its timeout: a peer failed or the schedule cannot proceed."""


def sender_stage(action: Action) -> int:
    """The stage that produces the message of a SEND/RECV action."""
    if action.kind == RECV_F:
        return action.stage - 1
    if action.kind == RECV_B:
        return action.stage + 1
    return action.stage


def peer_stage(action: Action) -> int:
    """The stage at the other end of a SEND/RECV action."""
    step = {SEND_F: 1, RECV_F: -1, SEND_B: -1, RECV_B: 1}[action.kind]
    return action.stage + step


def message_tag(action: Action, n_microbatches: int) -> int:
    """The same number on both ends of one message, distinct for every message of a step."""
    direction = FORWARD_DIRECTION if action.kind in (SEND_F, RECV_F) else BACKWARD_DIRECTION
    return (2 * sender_stage(action) + direction) * n_microbatches + action.mb


@dataclass
class PendingRecv:
    action: Action
    work: dist.Work
    buffer: torch.Tensor
    posted_s: float


def post(actions: list[Action], payloads: dict[Action, torch.Tensor], *, group: Group,
         n_microbatches: int, recv_buffer: Callable[[], torch.Tensor], placement: Placement = LOOP
         ) -> tuple[list[tuple[Action, torch.Tensor, dist.Work]], list[PendingRecv]]:
    """Post consecutive SEND/RECV actions as one batch on the pipeline ``group``.

    ``payloads`` holds the tensor of each SEND; ``recv_buffer()`` makes an empty buffer for a
    RECV. Peers are global ranks of the group (``group.ranks[pipeline rank]``).
    """
    pp = group.size()
    messages, sends, recvs = [], [], []
    for action in actions:
        peer = group.ranks[stage_rank(peer_stage(action), pp, placement)]
        tag = message_tag(action, n_microbatches)
        if action.kind in (SEND_F, SEND_B):
            tensor = payloads[action]
            messages.append(Message(SEND, tensor, peer, tag))
            sends.append((action, tensor))
        else:
            tensor = recv_buffer()
            messages.append(Message(RECV, tensor, peer, tag))
            recvs.append((action, tensor))
    posted_s = time.time()
    works = group.exchange(messages)
    kinds = [message.kind == SEND for message in messages]
    send_works = [(a, t, w) for (a, t), w in zip(sends, [w for s, w in zip(kinds, works) if s])]
    pending = [PendingRecv(a, w, t, posted_s)
               for (a, t), w in zip(recvs, [w for s, w in zip(kinds, works) if not s])]
    return send_works, pending


def wait_recv(pending: PendingRecv, timeout: Optional[timedelta], rank: int) -> torch.Tensor:
    """Block until ``pending`` has arrived; a timeout says which action and peer it was."""
    try:
        if timeout is None:
            pending.work.wait()
        else:
            pending.work.wait(timeout)
    except RuntimeError as error:
        waited = time.time() - pending.posted_s
        raise PipelineTimeout(
            f"pipeline rank {rank}: {pending.action} got nothing from stage "
            f"{peer_stage(pending.action)} after {waited:.1f}s; a peer failed or the schedule "
            f"deadlocks (check it with hybrid.planning.schedules.check.check_schedule): {error}"
        ) from error
    return pending.buffer


class SendsInFlight:
    """Posted sends, released (and their buffers freed) as soon as each completes."""

    def __init__(self, threaded: bool):
        self._threaded = threaded
        self._polled: list[tuple[dist.Work, torch.Tensor]] = []
        self._queue: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self.failed_label: object = None
        self._thread: Optional[threading.Thread] = None

    def add(self, work: dist.Work, tensor: torch.Tensor, label: object = None) -> None:
        """Hold ``tensor`` (the only reference left to a sent activation) until sent;
        ``label`` names the send in ``failed_label`` if it is the first to fail."""
        if not self._threaded:
            self._polled.append((work, tensor))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._wait_in_order, daemon=True,
                                            name="pipeline-sends")
            self._thread.start()
        self._queue.put((work, tensor, label))

    def release_finished(self) -> None:
        if not self._threaded:
            self._polled = [(w, t) for w, t in self._polled if not w.is_completed()]

    def wait_all(self) -> None:
        """Block until every send has completed (the end of a step); re-raise a failure."""
        if self._threaded and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        for work, _ in self._polled:
            work.wait()
        self._polled = []
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Stop tracking the sends after a failure, without waiting for them."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None
        self._polled = []

    def _wait_in_order(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, tensor, label = item
            try:
                work.wait()
            except BaseException as error:  # reported by wait_all, in the interpreter
                if self._error is None:
                    self._error, self.failed_label = error, label
            del work, tensor, item  # the buffer goes now, not when the next item arrives


def fifo_mismatches(lists: list[list[Action]], pp: int, placement: Placement = LOOP
                    ) -> list[tuple[int, int]]:
    """Directed rank pairs ``(src, dst)`` whose messages ``dst`` receives in another order than
    ``src`` sends them. Empty means the lowered ``lists`` are also safe on a backend that
    ignores tags and matches a pair's messages in posting order (NCCL)."""
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for rank, actions in enumerate(lists):
        for action in actions:
            if not action.is_comm:
                continue
            peer = stage_rank(peer_stage(action), pp, placement)
            message = (sender_stage(action), action.kind[-1], action.mb)
            if action.kind in (SEND_F, SEND_B):
                sent.setdefault((rank, peer), []).append(message)
            else:
                received.setdefault((peer, rank), []).append(message)
    return sorted(pair for pair in set(sent) | set(received)
                  if sent.get(pair) != received.get(pair))
