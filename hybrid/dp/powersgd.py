"""PowerSGD over the DP group (Vogels et al. 2019): rank-``r`` gradient compression with error
feedback and warm start, the algorithm of torch DDP's ``powerSGD_hook``.

Per bucket and step, for every gradient matrix ``M`` (``n x m``: the gradient viewed as
``shape[0]`` rows) that ``hybrid.planning.strategies.powersgd.compresses``, with this rank's error
``E`` and the shared warm-start ``Q`` (``m x r``)::

    M += E                      error feedback: what earlier steps' compression left out
    P  = M Q;   all-reduce P    (n x r, summed over DP), then orthonormalise its columns
    Q  = M^T P; all-reduce Q    (m x r, mean over DP); kept for the next step (warm start)
    E  = M - P Q^T;  M = P Q^T  the mean gradient's rank-r approximation, the rest kept

Vectors and matrices too small to shrink are all-reduced exactly in one flat buffer. The first
``powersgd_warmup`` steps reduce everything exactly (torch's ``start_powerSGD_iter``). The
``P`` all-reduce starts in the backward like any bucket's; the ``Q`` half runs in ``finish``.
Not with ZeRO (validated before launch): the shards would need the full approximation anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from hybrid.dp.buckets import Bucket
from hybrid.dp.reduce import ExactMean
from hybrid.dp.zero import Shard
from hybrid.planning.strategies.powersgd import as_matrix, compresses

Q_SEED = 20190527  # every DP rank draws the same initial Q


@dataclass(eq=False)
class _Matrix:
    slot: int
    rows: int
    cols: int
    error: torch.Tensor  # n x m, this rank's
    q: torch.Tensor  # m x r, the same on every DP rank


@dataclass(eq=False)
class _InFlight:
    """A bucket between its P all-reduce and its Q all-reduce."""

    matrices: list[torch.Tensor]  # the bucket's M (views of its gradient buffer)
    p: torch.Tensor  # every matrix's P, flat
    q: Optional[torch.Tensor] = None  # every matrix's new Q, flat


class PowerSGD(ExactMean):
    """The PowerSGD reducer: ``launch`` in the backward, ``finish`` after it."""

    def __init__(self, buckets: Sequence[Bucket], options, wait=None):
        super().__init__(buckets, options, wait)
        self.approx_rank, self.warmup = options.powersgd_rank, options.powersgd_warmup
        self.step = 0
        self.matrices = {b.index: self._matrices(b) for b in buckets}
        self.in_flight: dict[int, _InFlight] = {}

    def _matrices(self, bucket: Bucket) -> list[_Matrix]:
        found = []
        for slot, param in enumerate(bucket.params):
            if not compresses(tuple(param.shape), self.approx_rank):
                continue
            n, m = as_matrix(tuple(param.shape))
            gen = torch.Generator().manual_seed(Q_SEED + 1000 * bucket.index + slot)
            q = torch.randn(m, self.approx_rank, generator=gen).to(param.device)
            found.append(_Matrix(slot, n, m, torch.zeros(n, m, device=param.device), q))
        return found

    def start_step(self, step: int) -> None:
        self.step = step

    @property
    def compressing(self) -> bool:
        return self.step > self.warmup

    def state_tensors(self) -> list[torch.Tensor]:
        """What it keeps between steps (``memory_check.json`` counts them)."""
        return [t for ms in self.matrices.values() for x in ms for t in (x.error, x.q)]

    # ----- the two halves --------------------------------------------------------------------
    def launch(self, bucket: Bucket, shard: Optional[Shard]) -> None:
        assert shard is None, "PowerSGD does not run with ZeRO"
        mats = self.matrices[bucket.index]
        if not self.compressing or not mats:
            return super().launch(bucket, shard)
        compressed = {x.slot for x in mats}
        rest = [bucket.grad_view(s).reshape(-1) for s in range(len(bucket.params))
                if s not in compressed]
        if rest:
            flat = torch.cat(rest).mul_(1.0 / bucket.group.size())
            bucket.works.append(bucket.group.all_reduce(flat, async_op=True))
            bucket.on_done.append(lambda: _scatter_back(flat, rest))
        matrices = [bucket.grad_view(x.slot).view(x.rows, x.cols).add_(x.error) for x in mats]
        p = torch.cat([(mat @ x.q).reshape(-1) for mat, x in zip(matrices, mats)])
        bucket.works.append(bucket.group.all_reduce(p, async_op=True))
        self.in_flight[bucket.index] = _InFlight(matrices, p)

    def finish(self, buckets: Sequence[Bucket], wait: Callable) -> None:
        for bucket in buckets:  # every P (and the exact parts) in, then every Q out
            bucket.wait(wait)
            flight = self.in_flight.get(bucket.index)
            if flight is not None:
                flight.q = self._new_q(self.matrices[bucket.index], flight)
                bucket.works.append(bucket.group.all_reduce(flight.q, async_op=True))
        for bucket in buckets:
            bucket.wait(wait)
            flight = self.in_flight.pop(bucket.index, None)
            if flight is not None:
                self._decompress(self.matrices[bucket.index], flight, bucket.group.size())

    def _new_q(self, mats: list[_Matrix], flight: _InFlight) -> torch.Tensor:
        out, start = [], 0
        for mat, x in zip(flight.matrices, mats):
            p = flight.p[start:start + x.rows * self.approx_rank].view(x.rows, self.approx_rank)
            start += x.rows * self.approx_rank
            p.copy_(torch.linalg.qr(p).Q)  # orthonormal columns (scale-free: sum is fine)
            out.append((mat.T @ p).reshape(-1))
        return torch.cat(out)

    def _decompress(self, mats: list[_Matrix], flight: _InFlight, d: int) -> None:
        flight.q.mul_(1.0 / d)
        p_start = q_start = 0
        for mat, x in zip(flight.matrices, mats):
            p = flight.p[p_start:p_start + x.rows * self.approx_rank].view(x.rows, self.approx_rank)
            q = flight.q[q_start:q_start + x.cols * self.approx_rank].view(x.cols, self.approx_rank)
            p_start, q_start = p_start + p.numel(), q_start + q.numel()
            x.q.copy_(q)
            approx = p @ q.T
            x.error.copy_(mat).sub_(approx)
            mat.copy_(approx)

    # ----- checkpoints -----------------------------------------------------------------------
    def checkpoint_state(self, name_of: Callable[[int, int], str]) -> dict[str, torch.Tensor]:
        """``{name}.error`` and ``{name}.q`` of every compressed gradient, by parameter name."""
        out = {}
        for bucket_index, mats in self.matrices.items():
            for x in mats:
                name = name_of(bucket_index, x.slot)
                out[f"{name}.error"], out[f"{name}.q"] = x.error, x.q
        return out

    def load_checkpoint_state(self, states: dict[str, torch.Tensor],
                              name_of: Callable[[int, int], str]) -> None:
        for bucket_index, mats in self.matrices.items():
            for x in mats:
                name = name_of(bucket_index, x.slot)
                x.error.copy_(states[f"{name}.error"])
                x.q.copy_(states[f"{name}.q"])


def _scatter_back(flat: torch.Tensor, views: list[torch.Tensor]) -> None:
    start = 0
    for view in views:
        view.copy_(flat[start:start + view.numel()])
        start += view.numel()
