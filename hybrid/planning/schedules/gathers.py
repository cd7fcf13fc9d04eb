"""ZeRO-3's gathers and releases as schedule actions (pure; no torch).

Under ``parallel.zero=3`` a rank holds only its shard of each weight between uses. Its action
lists get ``UNSHARD`` and ``RESHARD`` actions (torch.distributed.pipelining's names):
between a stage's ``UNSHARD`` and ``RESHARD`` its computes may gather its weights, and its
``RESHARD`` releases all of them. An ``UNSHARD`` starts gathering the first block its stage's
next compute needs, and it stands in front of the compute before that one when that compute
is another stage's (prefetch: the gather runs behind it). Inside a compute the weights are
gathered one block at a time, as FSDP gathers one ``fully_shard`` unit: a block is gathered
before its forward (or its backward) while the next one in that direction is gathered behind
it (prefetch), and released after it. So the checker proves every compute runs inside its
stage's span, and ``walk_gathers`` replays the same lists, block by block, for the gathered
working set and the gather traffic that the trainer counts.

Which computes need the weights (``needs_weights``): a forward, a full backward and an
input-gradient backward (``I``); a weight-gradient backward (``W``) needs only the saved
inputs and output gradients, except on stage 0, where ``I`` has no input gradient to make and
leaves the whole backward to ``W``.

The two policies (``parallel.zero3_reshard``):

- ``after_forward``: each block released after each use and each stage after each compute:
  every block gathered once per forward and once per backward (2m a step for ``m``
  micro-batches); two blocks gathered at once, three while the next stage's first is
  prefetched.
- ``after_step``: blocks stay gathered until the stage's last use in the step: one gather a
  step, every stage of the rank held whole through its span.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from hybrid.planning.schedules.actions import (
    BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RESHARD, UNSHARD, Action, ScheduleError,
)

AFTER_FORWARD, AFTER_STEP = "after_forward", "after_step"
RESHARD_POLICIES = (AFTER_FORWARD, AFTER_STEP)


def needs_weights(action: Action) -> bool:
    """Whether ``action`` computes with its stage's weights (see the module doc)."""
    if not action.is_compute:
        return False
    if action.kind == BACKWARD_INPUT:
        return action.stage != 0
    if action.kind == BACKWARD_WEIGHT:
        return action.stage == 0
    return True


def add_gathers(lists: list[list[Action]], policy: str) -> list[list[Action]]:
    """Every rank's list with its ``UNSHARD``/``RESHARD`` actions under ``policy``."""
    if policy not in RESHARD_POLICIES:
        raise ScheduleError(f"unknown parallel.zero3_reshard={policy!r}; use one of "
                            f"{', '.join(RESHARD_POLICIES)}")
    return [_prefetched(_rank_gathers(actions, policy)) for actions in lists]


def strip_gathers(lists: list[list[Action]]) -> list[list[Action]]:
    """The lists without their gathers and releases (what the deadlock replay runs)."""
    return [[a for a in actions if not a.is_shard] for actions in lists]


def _rank_gathers(actions: Sequence[Action], policy: str) -> list[Action]:
    last_use = {a.stage: i for i, a in enumerate(actions) if needs_weights(a)}
    out: list[Action] = []
    gathered: set[int] = set()
    for i, action in enumerate(actions):
        uses = needs_weights(action)
        if uses and action.stage not in gathered:
            out.append(Action(action.stage, UNSHARD, action.mb))
            gathered.add(action.stage)
        out.append(action)
        if uses and (policy == AFTER_FORWARD or last_use[action.stage] == i):
            out.append(Action(action.stage, RESHARD, action.mb))
            gathered.discard(action.stage)
    return out


def _prefetched(actions: list[Action]) -> list[Action]:
    """Each ``UNSHARD`` moved in front of the compute before it when that compute is another
    stage's and the stage is not released in between: the first block it gathers then
    arrives while that compute runs."""
    out = list(actions)
    for k in range(len(out)):
        action = out[k]
        if action.kind != UNSHARD:
            continue
        j = k - 1
        while j >= 0 and not out[j].is_compute:
            if out[j].is_shard and out[j].stage == action.stage:
                break  # released just before: gathering earlier would undo it
            j -= 1
        if j >= 0 and out[j].is_compute and out[j].stage != action.stage:
            out.insert(j, out.pop(k))
    return out


def unshard_directions(actions: Sequence[Action]) -> list[int]:
    """For each ``UNSHARD`` in order, which way its stage's next compute walks the blocks:
    +1 (a forward: its first block first) or -1 (a backward: its last block first); the
    ``UNSHARD`` gathers that block ahead of it."""
    out = []
    for i, action in enumerate(actions):
        if action.kind == UNSHARD:
            nxt = next((a for a in actions[i + 1:]
                        if a.stage == action.stage and needs_weights(a)), None)
            out.append(+1 if nxt is None or nxt.kind == FORWARD else -1)
    return out


def check_gathers(actions: Sequence[Action], rank: int) -> None:
    """Raise ``ScheduleError`` unless every compute that needs weights runs on gathered ones,
    each ``UNSHARD`` gathers a released stage, each ``RESHARD`` releases a gathered one, and
    nothing is left gathered at the end of the step."""
    gathered: set[int] = set()
    for step, action in enumerate(actions):
        if action.kind == UNSHARD and action.stage in gathered:
            raise ScheduleError(f"rank {rank} step {step}: {action} gathers stage "
                                f"{action.stage}, which is gathered already; drop it")
        if action.kind == RESHARD and action.stage not in gathered:
            raise ScheduleError(f"rank {rank} step {step}: {action} releases stage "
                                f"{action.stage}, which is not gathered; drop it")
        if needs_weights(action) and action.stage not in gathered:
            raise ScheduleError(f"rank {rank} step {step}: {action} runs without its stage's "
                                f"weights; put {action.stage}{UNSHARD}{action.mb} before it")
        if action.kind == UNSHARD:
            gathered.add(action.stage)
        elif action.kind == RESHARD:
            gathered.discard(action.stage)
    if gathered:
        raise ScheduleError(f"rank {rank} ends the step with stages {sorted(gathered)} still "
                            f"gathered; release each with a {RESHARD} after its last use")


def walk_gathers(actions: Sequence[Action], stage_units: Mapping[int, Sequence[frozenset[int]]],
                 bucket_bytes: Sequence[int], policy: str) -> tuple[int, list[int]]:
    """(peak bytes of gathered buckets, gathers per bucket) of one rank's step, as the
    runtime (``hybrid.dp.zero3.StageWeights``) holds them. ``stage_units``: per stage, the
    buckets each of its blocks' weights lie in, in forward order. A bucket is gathered when a
    block using it becomes active and released when no active block uses it (one that
    straddles two blocks, or two stages, is gathered once)."""
    walk = _Walk(stage_units, bucket_bytes, policy == AFTER_FORWARD)
    directions = iter(unshard_directions(actions))
    for action in actions:
        if action.kind == UNSHARD:
            walk.first(action.stage, next(directions))
        elif action.kind == RESHARD:
            walk.deactivate({(action.stage, k) for k in range(len(stage_units[action.stage]))})
        elif needs_weights(action):
            n = len(stage_units[action.stage])
            if action.kind == FORWARD:
                walk.forward(action.stage, n)
            else:
                walk.backward(action.stage, n)
    return walk.peak, walk.gathers


class _Walk:
    """The runtime's hooks, replayed: what a block's forward and backward gather and free."""

    def __init__(self, units, bucket_bytes, per_use: bool):
        self.units, self.bytes, self.per_use = units, bucket_bytes, per_use
        self.active: set[tuple[int, int]] = set()
        self.live: set[int] = set()
        self.gathers = [0] * len(bucket_bytes)
        self.peak = 0

    def first(self, stage: int, direction: int) -> None:
        """``UNSHARD``: the first block the next compute needs starts gathering."""
        self.activate(stage, 0 if direction > 0 else len(self.units[stage]) - 1)

    def forward(self, stage: int, n: int) -> None:
        for k in range(n):
            self.enter(stage, k, +1, n)
            self.leave(stage, k)

    def backward(self, stage: int, n: int) -> None:
        """From the last block's output gradient down; the first block's input has a
        gradient (and so a hook that frees it) on every stage but stage 0."""
        self.enter(stage, n - 1, -1, n)
        for k in range(n - 1, 0, -1):
            self.leave(stage, k)
            self.enter(stage, k - 1, -1, n)
        if stage > 0:
            self.leave(stage, 0)

    def enter(self, stage: int, k: int, direction: int, n: int) -> None:
        self.activate(stage, k)
        if 0 <= k + direction < n:
            self.activate(stage, k + direction)

    def leave(self, stage: int, k: int) -> None:
        if self.per_use:
            self.deactivate({(stage, k)})

    def activate(self, stage: int, k: int) -> None:
        self.active.add((stage, k))
        for bucket in self.units[stage][k] - self.live:
            self.gathers[bucket] += 1
            self.live.add(bucket)
        self.peak = max(self.peak, sum(self.bytes[b] for b in self.live))

    def deactivate(self, units: set[tuple[int, int]]) -> None:
        self.active -= units
        self.live &= set().union(*(self.units[s][k] for s, k in self.active))
