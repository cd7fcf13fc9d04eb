"""``CommCounter``: calls and bytes of every collective this process issues, per parallel axis.

Inside ``with counter.track():`` every collective and point-to-point operation is counted and
attributed to the axis whose process group it ran on (``dp``, ``tp``, ``pp``; everything else,
e.g. the ``tp-pp`` group of the norm reduction, the ``embedding`` group or the world, goes to
``other``). This includes the ones megatron-core's TP layers issue internally.

Where the counting hooks in: every ``torch.distributed`` collective, however it is reached
(``dist.all_reduce``, ``dist.batch_isend_irecv``, megatron's import-time aliases of
``all_gather_into_tensor``), ends in one method call on the ``ProcessGroup`` object, with the
group as ``self``. So the counter wraps those ``ProcessGroup`` methods, for the duration of the
block only, and restores them on exit. This is the only place in hybrid that does so; it is a
private seam of torch, pinned by ``tests/test_comm.py``.

Byte definitions, for a tensor payload of ``n`` bytes in a group of ``d`` ranks:

- ``payload``: the bytes of the tensors this rank hands in (all-reduce: the tensor; reduce-
  scatter: the full input; all-gather: the full output; send/recv: the tensor).
- ``bytes``: the bytes this rank *sends* on the wire under ring algorithms: all-reduce
  ``2(d-1)/d·n``; reduce-scatter, all-gather, broadcast, reduce, all-to-all ``(d-1)/d·n``;
  send ``n``; recv ``0`` (the sender counts it). A 1-rank group moves nothing: ``0``.
  Summed over the ranks of a group this is the group's total traffic.

Calls count operations issued (a ``batch_isend_irecv`` of two ops counts two).

Given a ``watch`` (``hybrid.watch.RankWatch``), the same seam also hands it every collective
issued, with its options (whether the caller waits at once), so that it can time this rank's
waits per axis and say which operation a failed wait was.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

REPORTED_AXES = ("dp", "tp", "pp", "other")

# The flat-tensor collectives, by their torch 2.13 names (the old ones print a FutureWarning);
# torch >= 2.5 is allowed, which has only the old.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# ProcessGroup method -> (index of the argument that holds the payload, wire factor kind).
_ALL_REDUCE, _SCATTER_GATHER, _SEND, _RECV = "all_reduce", "scatter_gather", "send", "recv"
_METHODS: dict[str, tuple[int, str]] = {
    "allreduce": (0, _ALL_REDUCE),
    "allreduce_coalesced": (0, _ALL_REDUCE),
    "reduce_scatter": (1, _SCATTER_GATHER),
    "reduce_scatter_single": (1, _SCATTER_GATHER),
    "reduce_scatter_single_coalesced": (1, _SCATTER_GATHER),
    "reduce_scatter_tensor_coalesced": (1, _SCATTER_GATHER),
    "_reduce_scatter_base": (1, _SCATTER_GATHER),
    "allgather": (0, _SCATTER_GATHER),
    "allgather_coalesced": (0, _SCATTER_GATHER),
    "all_gather_single": (0, _SCATTER_GATHER),
    "all_gather_single_coalesced": (0, _SCATTER_GATHER),
    "allgather_into_tensor_coalesced": (0, _SCATTER_GATHER),
    "_allgather_base": (0, _SCATTER_GATHER),
    "broadcast": (0, _SCATTER_GATHER),
    "reduce": (0, _SCATTER_GATHER),
    "alltoall": (1, _SCATTER_GATHER),
    "alltoall_base": (1, _SCATTER_GATHER),
    "all_to_all_single": (1, _SCATTER_GATHER),
    "send": (0, _SEND),
    "recv": (0, _RECV),
    "recv_anysource": (0, _RECV),
}
_PATCH_LOCK = threading.Lock()


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or nested lists/tuples of tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def wire_bytes(kind: str, payload: int, group_size: int) -> float:
    """Bytes this rank sends for ``payload`` bytes under a ring algorithm (see module doc)."""
    if group_size <= 1:
        return 0.0
    if kind == _ALL_REDUCE:
        return 2.0 * (group_size - 1) / group_size * payload
    if kind == _SCATTER_GATHER:
        return (group_size - 1) / group_size * payload
    return float(payload) if kind == _SEND else 0.0


class CommCounter:
    """Counts collectives per axis of ``groups`` while ``track()`` is active.

    ``snapshot()`` -> ``{"dp": {"calls": int, "bytes": float, "payload": int}, "tp": ...,
    "pp": ..., "other": ...}``; ``reset()`` zeroes it (call both once per step for per-step
    figures). Process-local: each rank counts what it issues.
    """

    def __init__(self, groups: Optional[Any] = None, watch: Optional[Any] = None):
        self.groups, self.watch = groups, watch
        self._axis_of_group: dict[int, str] = {}
        if groups is not None:
            for axis in ("dp", "tp", "pp"):
                if axis in groups.group:
                    self._axis_of_group[id(groups.group[axis])] = axis
        self._counts = self._empty()

    @staticmethod
    def _empty() -> dict[str, dict[str, float]]:
        return {axis: {"calls": 0, "bytes": 0.0, "payload": 0} for axis in REPORTED_AXES}

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {axis: dict(c) for axis, c in self._counts.items()}

    def reset(self) -> None:
        self._counts = self._empty()

    def record(self, axis: str, kind: str, payload: int, group_size: int) -> None:
        entry = self._counts[axis]
        entry["calls"] += 1
        entry["payload"] += payload
        entry["bytes"] += wire_bytes(kind, payload, group_size)

    def axis_of(self, group: dist.ProcessGroup, kind: str, peer: Optional[int]) -> str:
        """The axis of ``group``; a point-to-point op on another group (e.g. the world) is
        attributed by its peer's global rank."""
        axis = self._axis_of_group.get(id(group))
        if axis is not None:
            return axis
        if kind in (_SEND, _RECV) and peer is not None and self.groups is not None:
            peer_global = dist.get_global_rank(group, peer)
            for candidate in ("pp", "dp", "tp"):
                if peer_global in self.groups.ranks.get(candidate, ()):
                    return candidate
        return "other"

    @contextlib.contextmanager
    def track(self) -> Iterator["CommCounter"]:
        """Count every collective issued inside the block (not re-entrant, one at a time)."""
        with _PATCH_LOCK:
            if getattr(dist.ProcessGroup.__dict__.get("allreduce"), "hybrid_counter", None):
                raise RuntimeError("another CommCounter is already tracking in this process; "
                                   "nest the work in one counter's track() instead")
            cls = dist.ProcessGroup
            names = [name for name in _METHODS if hasattr(cls, name)]
            # Restore the raw class-dict entries: getattr on a pybind11 class unwraps the
            # method into a plain builtin that would no longer bind ``self``.
            raw = {name: cls.__dict__.get(name) for name in names}
            for name in names:
                setattr(cls, name, self._wrap(name, getattr(cls, name)))
        try:
            yield self
        finally:
            with _PATCH_LOCK:
                for name, entry in raw.items():
                    if entry is None:
                        delattr(cls, name)
                    else:
                        setattr(cls, name, entry)

    def _wrap(self, name: str, original: Any) -> Any:
        arg_index, kind = _METHODS[name]
        counter = self

        def counted(group: dist.ProcessGroup, *args: Any, **kwargs: Any) -> Any:
            payload = tensor_bytes(args[arg_index]) if len(args) > arg_index else 0
            # send(tensors, dst, tag) / recv(tensors, src, tag); recv_anysource has no peer.
            peer = args[1] if name in ("send", "recv") and len(args) > 1 else None
            axis = counter.axis_of(group, kind, peer)
            counter.record(axis, kind, payload, group.size())
            watch = counter.watch
            if watch is None:
                return original(group, *args, **kwargs)
            watch.before_issue(axis)
            try:
                work = original(group, *args, **kwargs)
            except Exception:  # a peer already gone: the failure is this operation's
                watch.issue_failed(axis, name, group, peer)
                raise
            return watch.issued(work, axis, name, group, _options(args, kwargs))

        counted.__name__ = name
        counted.hybrid_counter = self  # marks the method as wrapped (see track)
        return counted


def _options(args: tuple, kwargs: dict) -> Any:
    """The collective's options object (``AllreduceOptions``, ...; has ``asyncOp``), if any."""
    for value in (*args, *kwargs.values()):
        if hasattr(value, "asyncOp"):
            return value
    return None
