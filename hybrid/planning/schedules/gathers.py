"""ZeRO-3's gathers and releases as schedule actions (pure; no torch).

Under ``parallel.zero=3`` a rank holds only its shard of each weight between uses; a stage's
weights are all-gathered over the sharding group before the compute that needs them and
released after. ``add_gathers`` writes that into each rank's action list as ``UNSHARD`` and
``RESHARD`` actions (torch.distributed.pipelining's names), so the checker proves every compute
runs on gathered weights, the memory walk counts the gathered working set, and the cost model
counts the gathers, from the same data the runtime executes.

Which computes need the weights (``needs_weights``): a forward, a full backward and an
input-gradient backward (``I``); a weight-gradient backward (``W``) needs only the saved
inputs and output gradients, except on stage 0, where ``I`` has no input gradient to make and
leaves the whole backward to ``W``.

The two policies (``parallel.zero3_reshard``):

- ``after_forward``: release after every use, so a stage is gathered once for each forward
  and once for each backward (2m gathers a step for ``m`` micro-batches): the least memory.
- ``after_step``: gather before a stage's first use in the step and release after its last:
  one gather a step, the stage's weights held whole through the step.

Prefetch: an ``UNSHARD`` moves in front of the compute before the one that needs it when that
compute is on another stage, so the gather runs while it computes (the runtime starts it and
waits only at the first use). A stage that is used back to back cannot be prefetched.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from hybrid.planning.schedules.actions import (
    BACKWARD_INPUT, BACKWARD_WEIGHT, RESHARD, UNSHARD, Action, ScheduleError,
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
    """Each ``UNSHARD`` moved in front of the previous compute when that compute is on
    another stage and the stage is not released in between."""
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
        if j < 0 or not out[j].is_compute or out[j].stage == action.stage:
            continue
        out.insert(j, out.pop(k))
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


def walk_gathers(actions: Sequence[Action], stage_buckets: Mapping[int, frozenset[int]],
                 bucket_bytes: Sequence[int]) -> tuple[int, list[int]]:
    """(peak bytes of gathered buckets, gathers per bucket) of one rank's step, as the
    runtime holds them: a bucket (``stage_buckets``: the buckets each stage's weights lie in)
    is gathered when a stage using it is, and released when no gathered stage uses it."""
    gathered: set[int] = set()
    live: set[int] = set()
    gathers = [0] * len(bucket_bytes)
    peak = 0
    for action in actions:
        if action.kind == UNSHARD:
            gathered.add(action.stage)
            for bucket in stage_buckets[action.stage] - live:
                gathers[bucket] += 1
                live.add(bucket)
            peak = max(peak, sum(bucket_bytes[b] for b in live))
        elif action.kind == RESHARD:
            gathered.discard(action.stage)
            still = set().union(*(stage_buckets[s] for s in gathered))
            live &= still
    return peak, gathers
