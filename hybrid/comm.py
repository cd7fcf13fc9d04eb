"""``Group``: a process group hybrid made, and the one way hybrid's code communicates.

Every collective and point-to-point message hybrid issues goes through a ``Group`` method: the
model's tensor-parallel regions (megatron-core's layers are built so that they issue none of
their own, ``hybrid.model.megatron_adapter``), the pipeline's messages, the DP reductions,
clipping and the trainer's per-step reductions. A group knows its torch group (``pg``), its
global ranks, its backend (and through it its ``transport`` profile) and the ``label`` its traffic is counted under (the axes of its role:
``dp``, ``cp-dp``, ``cp``, ``tp``, ``pp``, ``tp-pp``, ``embedding``, or ``world``).

While an observer is attached and active (``CommCounter``, during each training step), every
operation is counted and handed to the observer's ``RankWatch``, which times this rank's waits
and can say which operation a failed wait was, and which stops a rank on purpose for the tests
of the hang diagnosis (``hybrid.diagnosis.faults``). Nothing in torch is replaced or patched: a test
(``tests/test_comm.py``) runs training steps under a torch dispatch mode that sees every c10d
operation and checks that each one was counted here.

Byte definitions, for a tensor payload of ``n`` bytes in a group of ``d`` ranks:

- ``payload``: the bytes of the tensors this rank hands in (all-reduce: the tensor; reduce-
  scatter: the full input; all-gather: the full output; send/recv: the tensor).
- ``bytes``: the bytes this rank *sends* on the wire under ring algorithms: all-reduce
  ``2(d-1)/d·n``; reduce-scatter, all-gather ``(d-1)/d·n``; send ``n``; recv ``0`` (the
  sender counts it); all-to-all: the input rows bound for the other ranks. A 1-rank group moves nothing: ``0``. Summed over the ranks of a group
  this is the group's total traffic.

Calls count operations issued (a batch of two point-to-point messages counts two).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from hybrid.planning.layout import COORD_ORDER
from hybrid.transport import Transport, transport_for

REPORTED_AXES = (*COORD_ORDER, "ep", "other")
"""The labels ``CommCounter`` reports; a group labelled otherwise counts as ``other``."""
REPORTED_AS = {"cp-dp": "dp", "edp": "dp"}
"""Groups reported under another axis: the gradient reduction over dp x cp is DP traffic
(megatron's ``dp_cp`` group), and so is an expert's over its expert data-parallel group."""
ALL_REDUCE, GATHER_SCATTER, SEND, RECV = "all_reduce", "gather_scatter", "send", "recv"
ALL_TO_ALL = "all_to_all"
"""An all-to-all's wire bytes are those it sends to the other ranks (its own rows stay)."""

# The flat-tensor collectives, by their torch 2.13 names (the old ones print a FutureWarning);
# torch >= 2.5 is allowed, which has only the old.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reported_axis(label: str) -> str:
    """The axis a group's traffic is reported under: its label, or ``other``."""
    label = REPORTED_AS.get(label, label)
    return label if label in REPORTED_AXES else "other"


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or nested lists/tuples of tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def wire_bytes(kind: str, payload: int, group_size: int, sent: int = 0) -> float:
    """Bytes this rank sends for ``payload`` bytes under a ring algorithm (see module doc);
    ``sent``: an all-to-all's bytes bound for the other ranks."""
    if group_size <= 1:
        return 0.0
    if kind == ALL_TO_ALL:
        return float(sent)
    if kind == ALL_REDUCE:
        return 2.0 * (group_size - 1) / group_size * payload
    if kind == GATHER_SCATTER:
        return (group_size - 1) / group_size * payload
    return float(payload) if kind == SEND else 0.0


@dataclass(frozen=True)
class Message:
    """One point-to-point message of a batch: ``send`` or ``recv`` of ``tensor`` with the
    global rank ``peer``, matched on both ends by ``tag``."""

    kind: str
    tensor: torch.Tensor
    peer: int
    tag: int


@dataclass(eq=False)
class Group:
    """A torch process group as hybrid uses it (see the module doc)."""

    pg: dist.ProcessGroup
    ranks: list[int]
    """Global ranks, in group-rank order."""
    label: str
    backend: str
    observer: Optional["CommCounter"] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._size, self._rank = self.pg.size(), self.pg.rank()

    @property
    def transport(self) -> Transport:
        """What this group's backend supports and how hybrid drives it
        (``hybrid.transport``)."""
        return transport_for(self.backend)

    @classmethod
    def world(cls) -> "Group":
        """The default group of every process of the job."""
        pg = dist.group.WORLD
        return cls(pg, list(range(dist.get_world_size())), "world", dist.get_backend(pg))

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        """This rank's place in the group."""
        return self._rank

    # ----- collectives -----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """In-place sum (or ``op``) of ``tensor`` over the group."""
        return self._collective("all_reduce", ALL_REDUCE, tensor_bytes(tensor), async_op,
                                lambda: dist.all_reduce(tensor, op=op, group=self.pg,
                                                        async_op=True))

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        """Every rank's ``tensor`` into ``out`` (``size()`` times larger, rank order)."""
        return self._collective("all_gather", GATHER_SCATTER, tensor_bytes(out), async_op,
                                lambda: _all_gather_flat(out, tensor, group=self.pg,
                                                         async_op=True))

    def all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Every rank's ``tensor`` into the list ``outs`` (one tensor per rank)."""
        self._collective("all_gather", GATHER_SCATTER, tensor_bytes(outs), False,
                         lambda: dist.all_gather(outs, tensor, group=self.pg, async_op=True))

    def reduce_scatter_into(self, out: torch.Tensor, tensor: torch.Tensor,
                            async_op: bool = False):
        """The sum over the group of ``tensor``'s ``rank()``-th slice, into ``out``."""
        return self._collective("reduce_scatter", GATHER_SCATTER, tensor_bytes(tensor),
                                async_op, lambda: _reduce_scatter_flat(
                                    out, tensor, group=self.pg, async_op=True))

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> None:
        """Rows ``in_splits[j]`` of ``tensor`` (in rank order) to rank ``j``; rank ``j``'s rows
        for this rank into ``out``, ``out_splits[j]`` of them (uneven splits: gloo runs
        ``all_to_all_single`` with split sizes, not the list form)."""
        row = tensor[:1].numel() * tensor.element_size() if tensor.dim() else 0
        sent = row * (sum(in_splits) - in_splits[self.rank()])
        self._collective("all_to_all", ALL_TO_ALL, tensor_bytes(tensor), False,
                         lambda: dist.all_to_all_single(out, tensor, out_splits, in_splits,
                                                        group=self.pg, async_op=True),
                         sent=sent)

    def _collective(self, op: str, kind: str, payload: int, async_op: bool,
                    issue: Callable[[], dist.Work], sent: int = 0):
        """Issue ``issue()`` (always asynchronous underneath); a synchronous call waits here.
        With an active observer it is counted and watched first."""
        observer = self.observer
        if observer is not None and observer.active:
            work = observer.collective(self, op, kind, payload, issue, waits=not async_op,
                                       sent=sent)
        else:
            work = issue()
        if async_op:
            return work
        if work is not None:
            work.wait()
        return None

    # ----- objects and barriers (between steps: not counted) --------------------------------
    def all_gather_objects(self, obj: Any) -> list:
        """Every rank's picklable ``obj``, in group-rank order."""
        out = [None] * self.size()
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def gather_objects(self, obj: Any, dst: int) -> Optional[list]:
        """Every rank's picklable ``obj`` on global rank ``dst`` (None on the others)."""
        out = [None] * self.size() if dist.get_rank() == dst else None
        dist.gather_object(obj, out, dst=dst, group=self.pg)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    # ----- point-to-point --------------------------------------------------------------------
    def exchange(self, messages: Sequence[Message]) -> list[dist.Work]:
        """Post ``messages`` as one ``batch_isend_irecv``; one ``Work`` per message."""
        ops = [dist.P2POp(dist.isend if m.kind == SEND else dist.irecv, m.tensor, m.peer,
                          self.pg, m.tag) for m in messages]
        observer = self.observer
        if observer is not None and observer.active:
            works = observer.exchange(self, messages, lambda: dist.batch_isend_irecv(ops))
        else:
            works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):
            # NCCL-style coalescing returns one Work that stands for the whole batch.
            assert len(works) == 1, f"{len(works)} works for {len(ops)} point-to-point ops"
            works = works * len(ops)
        return works


class CommCounter:
    """Counts every operation of ``groups``' ``Group``s per label while ``track()`` is active.

    ``snapshot()`` -> ``{"dp": {"calls": int, "bytes": float, "payload": int}, "tp": ...,
    "pp": ..., "other": ...}``; ``reset()`` zeroes it (call both once per step for per-step
    figures). Process-local: each rank counts what it issues. ``watch``
    (``hybrid.diagnosis.watch.RankWatch``) is handed every operation too, to time the waits.
    """

    def __init__(self, groups: Optional[Any] = None, watch: Optional[Any] = None):
        self.watch, self.active = watch, False
        self._counts = self._empty()
        self.group_bytes: dict[str, float] = {}
        """Wire bytes per group label (``cp-dp`` and ``edp`` are both DP traffic: the dense
        and the expert gradient groups); ``reset`` empties it."""
        if groups is not None:
            groups.observe(self)

    @staticmethod
    def _empty() -> dict[str, dict[str, float]]:
        return {axis: {"calls": 0, "bytes": 0.0, "payload": 0} for axis in REPORTED_AXES}

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {axis: dict(c) for axis, c in self._counts.items()}

    def reset(self) -> None:
        self._counts = self._empty()
        self.group_bytes = {}

    def axis_group_bytes(self, axis: str) -> dict[str, float]:
        """Bytes per group label of the groups reported under ``axis``."""
        return {label: sent for label, sent in self.group_bytes.items()
                if reported_axis(label) == axis}

    @contextlib.contextmanager
    def track(self) -> Iterator["CommCounter"]:
        """Count every operation issued inside the block (not re-entrant)."""
        if self.active:
            raise RuntimeError("this CommCounter is already tracking; nest the work in one "
                               "track() instead")
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def record(self, label: str, kind: str, payload: int, group_size: int,
               sent: int = 0) -> None:
        entry = self._counts[reported_axis(label)]
        entry["calls"] += 1
        entry["payload"] += payload
        wire = wire_bytes(kind, payload, group_size, sent)
        entry["bytes"] += wire
        self.group_bytes[label] = self.group_bytes.get(label, 0.0) + wire

    # ----- called by Group -------------------------------------------------------------------
    def collective(self, group: Group, op: str, kind: str, payload: int,
                   issue: Callable[[], dist.Work], waits: bool, sent: int = 0
                   ) -> Optional[dist.Work]:
        self.record(group.label, kind, payload, group.size(), sent)
        watch = self.watch
        if watch is None:
            return issue()
        axis = reported_axis(group.label)
        watch.before_issue(axis)
        try:
            work = issue()
        except Exception:  # a peer already gone: the failure is this operation's
            watch.issue_failed(axis, op, group, None)
            raise
        return watch.issued(work, axis, op, group, waits)

    def exchange(self, group: Group, messages: Sequence[Message],
                 issue: Callable[[], list]) -> list:
        axis = reported_axis(group.label)
        for message in messages:
            self.record(group.label, message.kind, tensor_bytes(message.tensor), group.size())
            if self.watch is not None:
                self.watch.before_issue(axis)
        try:
            return issue()
        except Exception:
            if self.watch is not None:
                self.watch.issue_failed(axis, messages[0].kind, group, messages[0].peer)
            raise
