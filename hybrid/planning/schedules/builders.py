"""Pipeline schedules as data: per-rank lists of compute actions, and the lowering pass that
adds point-to-point communication (pure; no torch).

``build_schedule(name, pp, m, vpp)`` returns compute-only lists (F/B/I/W);
``add_communication(lists, pp, vpp)`` inserts SEND/RECV actions; ``check.check_schedule``
proves either form complete and deadlock-free.
"""

from __future__ import annotations

from hybrid.planning.schedules.actions import (
    BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F,
    LOOP, V_SHAPE, Action, ScheduleError, stage_rank,
)

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")


def schedule_placement(name: str) -> str:
    """Where schedule ``name`` puts its stages: ``actions.V_SHAPE`` for zb-v, else ``LOOP``."""
    return V_SHAPE if name == "zb-v" else LOOP


def build_schedule(name: str, pp: int, m: int, vpp: int = 1) -> list[list[Action]]:
    """Compute-only action lists (one per pipeline rank) of schedule ``name``.

    ``pp`` pipeline ranks, ``m`` micro-batches, ``vpp`` virtual chunks per rank. Stage ``s``
    runs on rank ``stage_rank(s, pp, schedule_placement(name))``. gpipe and 1f1b use fused
    ``B``; zb-h1 and zb-v use ``I`` then ``W``.
    """
    _check_sizes(name, pp, m, vpp)
    if name == "gpipe":
        return [_gpipe_rank(rank, m) for rank in range(pp)]
    if name == "1f1b":
        return [_one_f_one_b_rank(rank, pp, m) for rank in range(pp)]
    if name == "interleaved-1f1b":
        return [_interleaved_rank(rank, pp, m, vpp) for rank in range(pp)]
    if name == "zb-v":
        return [_zero_bubble_v_rank(rank, pp, m) for rank in range(pp)]
    return [_zero_bubble_h1_rank(rank, pp, m) for rank in range(pp)]


def _check_sizes(name: str, pp: int, m: int, vpp: int) -> None:
    if name not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULE_NAMES)}")
    for field, value in (("pp", pp), ("micro-batches", m), ("vpp", vpp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} needs {field} to be an integer >= 1, got {value!r}")
    if name == "interleaved-1f1b":
        if vpp < 2:
            raise ScheduleError(
                f"interleaved-1f1b needs vpp >= 2 virtual chunks per rank (got {vpp}); "
                f"set vpp >= 2 or use schedule 1f1b"
            )
        if m % pp:
            raise ScheduleError(
                f"interleaved-1f1b needs micro-batches ({m}) to be a multiple of pp ({pp}); "
                f"use {m + (-m) % pp} micro-batches or another schedule"
            )
    elif name == "zb-v":
        if vpp != 2:
            raise ScheduleError(f"zb-v runs exactly 2 chunks per rank in a V, got vpp={vpp}; "
                                f"set vpp=2 or use schedule zb-h1")
    elif vpp != 1:
        raise ScheduleError(
            f"{name} runs one chunk per rank, got vpp={vpp}; set vpp=1 or use interleaved-1f1b"
        )


def _gpipe_rank(rank: int, m: int) -> list[Action]:
    """All forwards, then all backwards (in micro-batch order, as torch's ScheduleGPipe)."""
    return ([Action(rank, FORWARD, mb) for mb in range(m)]
            + [Action(rank, BACKWARD, mb) for mb in range(m)])


def _one_f_one_b_rank(rank: int, pp: int, m: int) -> list[Action]:
    """PipeDream-Flush 1F1B: ``pp - rank - 1`` warm-up forwards, then alternate F and B.

    At most ``min(pp - rank, m)`` micro-batches are in flight on a rank, whatever ``m`` is.
    """
    warmup = min(pp - rank - 1, m)
    order = [Action(rank, FORWARD, mb) for mb in range(warmup)]
    for mb in range(m):
        if warmup + mb < m:
            order.append(Action(rank, FORWARD, warmup + mb))
        order.append(Action(rank, BACKWARD, mb))
    return order


def _interleaved_rank(rank: int, pp: int, m: int, vpp: int) -> list[Action]:
    """Megatron's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``).

    The ``k``-th forward of a rank runs chunk ``(k % (pp*vpp)) // pp`` on micro-batch
    ``(k // (pp*vpp)) * pp + k % pp``: groups of ``pp`` micro-batches go through chunk 0, then
    chunk 1, ...; backwards visit the chunks in reverse. Warm-up is Megatron's
    ``2 * (pp - rank - 1) + (vpp - 1) * pp`` forwards, then one forward per backward.
    """
    group = pp * vpp
    total = m * vpp

    def nth(k: int, kind: str) -> Action:
        chunk = (k % group) // pp
        if kind == BACKWARD:
            chunk = vpp - 1 - chunk
        mb = (k // group) * pp + k % pp
        return Action(chunk * pp + rank, kind, mb)

    warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
    order = [nth(k, FORWARD) for k in range(warmup)]
    for k in range(total):
        if warmup + k < total:
            order.append(nth(warmup + k, FORWARD))
        order.append(nth(k, BACKWARD))
    return order


def _zero_bubble_h1_rank(rank: int, pp: int, m: int) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with B split in I+W.

    The critical path runs through F and I only, so each rank does its I as early as 1F1B
    does its B and delays W: rank ``r`` keeps ``r`` weight-gradients pending, which fills the
    cool-down bubble of the earlier ranks. Warm-up forwards plus pending W stay at ``pp - 1``,
    so every rank holds the activations of at most ``pp`` micro-batches: the first rank's
    peak, as in 1F1B, now on every rank (1F1B's later ranks hold fewer). The bubble shrinks
    to ``(pp-1)*(F+I-W)``.
    """
    warmup = min(pp - rank - 1, m)
    delay = rank
    order = [Action(rank, FORWARD, mb) for mb in range(warmup)]
    for mb in range(m):
        if warmup + mb < m:
            order.append(Action(rank, FORWARD, warmup + mb))
        order.append(Action(rank, BACKWARD_INPUT, mb))
        if mb >= delay:
            order.append(Action(rank, BACKWARD_WEIGHT, mb - delay))
    order += [Action(rank, BACKWARD_WEIGHT, mb) for mb in range(max(m - delay, 0), m)]
    return order


def _zero_bubble_v_rank(rank: int, pp: int, m: int) -> list[Action]:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): two chunks per rank in a
    V, chunk 0 = stage ``rank`` (going down the ranks), chunk 1 = stage ``2*pp - 1 - rank``
    (coming back up), so rank 0 holds the first and the last stage.

    Warm-up: ``2*(pp - rank) - 1`` chunk-0 forwards (the V's down leg must reach the last rank
    before any chunk-1 work arrives), then ``rank`` chunk-1/chunk-0 forward pairs, then
    ``pp - rank`` chunk-1 forwards each followed at once by its I and W (the up leg's
    backward starts on rank 0, where the loss is). Steady state: F, I, W of chunk 0 then of
    chunk 1. Cool-down: the remaining I of both chunks, the W left over fill the gaps. At
    most ``2*pp`` chunk activations are held per rank: ``pp`` micro-batches of a whole stage,
    1F1B's first-rank peak, with a bubble about half ZB-H1's (with F = I = W).
    """
    stages = (rank, 2 * pp - 1 - rank)
    done = {(kind, chunk): 0 for kind in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
            for chunk in (0, 1)}
    order: list[Action] = []

    def run(kind: str, chunk: int, limit: int) -> None:
        """Add the chunk's next ``kind`` action if fewer than ``limit`` have been added."""
        if done[(kind, chunk)] < limit:
            order.append(Action(stages[chunk], kind, done[(kind, chunk)]))
            done[(kind, chunk)] += 1

    def backward(chunk: int, weight_too: bool) -> None:
        run(BACKWARD_INPUT, chunk, done[(FORWARD, chunk)])
        if weight_too:
            run(BACKWARD_WEIGHT, chunk, done[(BACKWARD_INPUT, chunk)])

    for _ in range(2 * (pp - rank) - 1):
        run(FORWARD, 0, m)
    for _ in range(rank):
        run(FORWARD, 1, m)
        run(FORWARD, 0, m)
    for _ in range(pp - rank):
        run(FORWARD, 1, m)
        backward(1, weight_too=True)
    while done[(FORWARD, 0)] < m or done[(FORWARD, 1)] < m:
        for chunk in (0, 1):
            run(FORWARD, chunk, m)
            backward(chunk, weight_too=True)
    for _ in range(rank):
        backward(1, weight_too=False)
        backward(0, weight_too=False)
    while done[(BACKWARD_INPUT, 0)] < m or done[(BACKWARD_INPUT, 1)] < m:
        backward(1, weight_too=False)
        backward(0, weight_too=False)
        if done[(BACKWARD_WEIGHT, 1)] < done[(BACKWARD_INPUT, 1)]:
            run(BACKWARD_WEIGHT, 1, m)
        else:
            run(BACKWARD_WEIGHT, 0, m)
    for chunk in (1, 0):
        for _ in range(m):
            run(BACKWARD_WEIGHT, chunk, m)
    return order


# ----- lowering: add point-to-point communication --------------------------------------------
def add_communication(compute_lists: list[list[Action]], pp: int, vpp: int = 1,
                      placement: str = LOOP) -> list[list[Action]]:
    """Insert SEND/RECV actions around the compute actions that cross ranks.

    A RECV goes right before the compute that consumes it and a SEND right after the compute
    that produced it. Under the runtime's semantics (SEND is posted and completes on its own;
    RECV blocks until the peer has posted the matching SEND) this is deadlock-free exactly when
    the compute-only lists are, so no RECV needs to move earlier. With ``pp == 1`` every
    neighbour is local and nothing is added.
    """
    if len(compute_lists) != pp:
        raise ScheduleError(f"got {len(compute_lists)} rank lists for pp={pp}; pass one per rank")
    n_stages = pp * vpp
    lowered: list[list[Action]] = []
    for actions in compute_lists:
        out: list[Action] = []
        for action in actions:
            if action.is_comm:
                raise ScheduleError(f"{action} is already a communication action; "
                                    f"call add_communication on compute-only lists")
            before, after = _comms_around(action, pp, n_stages, placement)
            out += before + [action] + after
        lowered.append(out)
    return lowered


def _comms_around(action: Action, pp: int, n_stages: int, placement: str
                  ) -> tuple[list[Action], list[Action]]:
    """The RECVs to put before ``action`` and the SENDs after it."""
    s, mb = action.stage, action.mb
    here = stage_rank(s, pp, placement)
    has_prev = s > 0 and stage_rank(s - 1, pp, placement) != here
    has_next = s < n_stages - 1 and stage_rank(s + 1, pp, placement) != here
    if action.kind == FORWARD:
        return ([Action(s, RECV_F, mb)] if has_prev else [],
                [Action(s, SEND_F, mb)] if has_next else [])
    if action.is_backward_input:
        return ([Action(s, RECV_B, mb)] if has_next else [],
                [Action(s, SEND_B, mb)] if has_prev else [])
    return [], []  # W needs nothing from another rank
