"""A transport profile: what a process-group backend supports and how hybrid drives it.

One profile per backend (gloo on CPU, NCCL on CUDA), chosen once with the groups
(``transport_of(device)``, ``ParallelGroups.create``) and read through ``Group.transport``,
so the runtime asks what a transport does instead of branching on its name. What differs:

- **Where tensors live** (``tensor_device``): gloo takes CPU tensors; NCCL the rank's GPU.
- **How point-to-point messages are matched** (``matches_tags``): gloo matches a RECV to its
  SEND by tag, so a schedule may post them in any order (the interleaved and zero-bubble
  placements do); NCCL runs them in the order of issue on one stream, so only schedules
  whose two ends post in the same order (loop-placed) run on it.
- **How early a RECV is posted** (``recv_lookahead``): a gloo send waits for its receiver
  to post the RECV before moving the data, about one round trip more per message (a 256 KB
  ping-pong on one machine: ~3.7 ms with receives posted late, ~0.8 ms early), so each RECV
  is posted this many compute actions before the one that consumes it (posting never
  blocks: this cannot deadlock). On NCCL an early RECV could hold back a SEND on the same
  stream: 0 keeps the schedule's order.
- **How sends are released** (``threaded_sends``): gloo's ``is_completed()`` does not
  progress a send, so a thread waits on them in order; NCCL's are polled.
- **Its clock** (``settle``): NCCL and the compute run on CUDA streams, so a span measured
  on the host must first wait for the queued kernels; gloo's work is done when the call
  returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Transport:
    """The profile of one backend (the module doc says what each field means)."""

    backend: str
    on_cuda: bool
    matches_tags: bool
    recv_lookahead: int
    threaded_sends: bool

    def tensor_device(self) -> torch.device:
        """Where this transport's collectives take their tensors (this process's GPU)."""
        if self.on_cuda:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def settle(self, device: torch.device) -> None:
        """Wait for the work queued on ``device``, so a host clock read after it measures
        the work, not its launch (nothing to wait for off CUDA)."""
        if self.on_cuda:
            torch.cuda.synchronize(device)


GLOO = Transport("gloo", on_cuda=False, matches_tags=True, recv_lookahead=2,
                 threaded_sends=True)
NCCL = Transport("nccl", on_cuda=True, matches_tags=False, recv_lookahead=0,
                 threaded_sends=False)
TRANSPORTS = {profile.backend: profile for profile in (GLOO, NCCL)}


def transport_for(backend: str) -> Transport:
    """The profile of ``backend`` (a torch process group's ``get_backend`` name)."""
    try:
        return TRANSPORTS[backend]
    except KeyError:
        # hybrid makes only the groups it has profiles for: another is a bug, with its traceback
        raise ValueError(f"process-group backend {backend!r} has no transport profile; "
                             f"hybrid runs on {' or '.join(TRANSPORTS)}") from None


def transport_of(device: torch.device) -> Transport:
    """The transport for a rank computing on ``device``: NCCL on CUDA, else gloo."""
    return NCCL if device.type == "cuda" else GLOO
