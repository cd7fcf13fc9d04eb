"""DualPipeV (DeepSeek-V3, Liu et al. 2024, arXiv 2412.19437; the "cut in half" V form of
DualPipe, as torch.distributed.pipelining's ``ScheduleDualPipeV``): two chunks per rank on
ZB-V's V (rank ``r`` holds stages ``r`` and ``2*pp - 1 - r``), and in the steady state each
step is one micro-batch's forward of one chunk overlapped with another micro-batch's full
backward of the other chunk: one ``Composite`` action (``dualpipev_steps``). On a GPU the
pair's two parts would run on two streams, so that one's communication (MoE's all-to-all, the
p2p) hides under the other's compute; ``build_schedule`` gives the pair as its two parts in
order, forward first (torch's ``OVERLAP_F_B`` sub-actions, in the same order), which is what
the CPU runtime runs.

Both forms equal torch 2.13's ``ScheduleDualPipeV.pipeline_order`` rank by rank, the pair as
one composite or as its two parts (``tests/test_dualpipev.py``).
"""

from __future__ import annotations

from hybrid.planning.schedules.actions import (
    BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, V_SHAPE, Action, Composite, flatten,
)
from hybrid.planning.schedules.registry import TWO, ScheduleSpec, register_schedule


class _RankBuilder:
    """One rank's list, grown phase by phase; counts the next micro-batch of each
    (stage, kind) and queues the weight gradients that an input-only backward leaves."""

    def __init__(self, rank: int, pp: int) -> None:
        self.stages = (rank, 2 * pp - 1 - rank)
        self.next_mb: dict[tuple[int, str], int] = {}
        self.weights_pending: list[tuple[int, int]] = []
        self.actions: list[Action | Composite] = []

    def add(self, chunk: int, kind: str) -> None:
        """The chunk's next ``kind`` (F, B or I: B and I share the backward count)."""
        stage = self.stages[chunk]
        key = (stage, FORWARD if kind == FORWARD else BACKWARD_INPUT)
        mb = self.next_mb.get(key, 0)
        self.next_mb[key] = mb + 1
        self.actions.append(Action(stage, kind, mb))
        if kind == BACKWARD_INPUT:
            self.weights_pending.append((stage, mb))

    def overlap(self, forward_chunk: int) -> None:
        """One overlapped pair: the forward of ``forward_chunk``, the full backward of the
        other chunk."""
        self.add(forward_chunk, FORWARD)
        self.add(1 - forward_chunk, BACKWARD)
        backward = self.actions.pop()
        self.actions.append(Composite((self.actions.pop(), backward)))

    def oldest_weight(self) -> None:
        """The oldest pending weight gradient, if any."""
        if self.weights_pending:
            stage, mb = self.weights_pending.pop(0)
            self.actions.append(Action(stage, BACKWARD_WEIGHT, mb))


class _PairCounter:
    """``_RankBuilder``'s moves, counting only the overlapped pairs by forward chunk: what
    the cost model prices, without building a list (a search prices hundreds of shapes)."""

    def __init__(self) -> None:
        self.pairs = [0, 0]

    def add(self, chunk: int, kind: str) -> None:
        pass

    def overlap(self, forward_chunk: int) -> None:
        self.pairs[forward_chunk] += 1

    def oldest_weight(self) -> None:
        pass


def _dualpipev_rank(rank: int, pp: int, m: int) -> list[Action | Composite]:
    b = _RankBuilder(rank, pp)
    _phases(b, rank, pp, m)
    return b.actions


def dualpipev_pairs(pp: int, m: int, vpp: int = 2) -> list[list[tuple[int, int, int]]]:
    """Per rank, (forward stage, backward stage, how many) of its overlapped pairs: the
    counts of ``dualpipev_steps``' composites, from the same phases
    (``tests/test_dualpipev_cost.py``)."""
    out = []
    for rank in range(pp):
        counter = _PairCounter()
        _phases(counter, rank, pp, m)
        down, up = rank, 2 * pp - 1 - rank
        out.append([(f, b, n) for (f, b), n in (((down, up), counter.pairs[0]),
                                                ((up, down), counter.pairs[1])) if n])
    return out


def _phases(b, rank: int, pp: int, m: int) -> None:
    """Eight phases, as DeepSeek's reference: warm up chunk 0, then pairs of chunk 0 and 1
    forwards, the up leg's first backwards split (I now, W later) to fill the bubble, the
    overlapped steady state, and a cool-down whose second half splits again (rank parity
    decides where the split starts) so that deferred W's fill the drain. ``b``: a
    ``_RankBuilder`` or a ``_PairCounter``."""
    for _ in range(2 * (pp - rank - 1)):
        b.add(0, FORWARD)
    for _ in range(rank + 1):
        b.add(0, FORWARD)
        b.add(1, FORWARD)
    for _ in range(pp - rank - 1):
        b.add(1, BACKWARD_INPUT)
        b.oldest_weight()
        b.add(1, FORWARD)
    for step in range(m - 2 * pp + rank + 1):
        if step == 0 and rank == pp - 1:  # not overlapped: a smaller bubble (the reference)
            b.add(0, FORWARD)
            b.add(1, BACKWARD)
        else:
            b.overlap(forward_chunk=0)
        b.overlap(forward_chunk=1)
    for _ in range(pp - rank - 1):
        b.add(1, BACKWARD)
        b.overlap(forward_chunk=1)
    split = False
    for step in range(rank + 1):
        split = split or (step == (rank + 1) // 2 and rank % 2 == 1)
        b.add(1, BACKWARD_INPUT if split else BACKWARD)
        split = split or (step == (rank + 1) // 2 and rank % 2 == 0)
        b.add(0, BACKWARD_INPUT if split else BACKWARD)
    for _ in range(pp - rank - 1):
        b.oldest_weight()
        b.add(0, BACKWARD_INPUT if split else BACKWARD)
    for _ in range(rank + 1):
        b.oldest_weight()


def dualpipev_steps(pp: int, m: int) -> list[list[Action | Composite]]:
    """The lists with each overlapped pair one ``Composite`` (torch's ``OVERLAP_F_B``): the
    form a two-stream GPU runtime would run (docs/pipeline.md, "Composite actions")."""
    return [_dualpipev_rank(rank, pp, m) for rank in range(pp)]


def _dualpipev_lists(pp: int, m: int, vpp: int) -> list[list[Action]]:
    return flatten(dualpipev_steps(pp, m))


def _dualpipev_closed_form(pp: int, m: int, vpp: int) -> tuple[float, tuple[int, ...]]:
    # the simulation's (tests/test_dualpipev.py) with a pair's parts serialised, as on CPU:
    # ZB-V's makespan 6m + pp - 1; the steady state holds one chunk more than ZB-V (2pp + 1)
    return (pp - 1) / (6 * m + pp - 1), tuple([2 * pp + 1] * pp)


DUALPIPEV = register_schedule(ScheduleSpec(
    name="dualpipev", build=_dualpipev_lists, closed_form=_dualpipev_closed_form,
    warmup_step=lambda forward, backward, vpp: forward / vpp,
    chunks=TWO, instead="zb-v", placement=V_SHAPE, tag_matched=True, min_microbatches_per_pp=2,
    steps=lambda pp, m, vpp: dualpipev_steps(pp, m), pairs=dualpipev_pairs, search_vpps=(2,),
    doc="DeepSeek-V3's DualPipeV: ZB-V's V, each steady step one chunk's F overlapped with "
        "the other's B; gloo only"))
