"""Context parallelism on the torch side: a rank's share of each sequence, and causal attention
over a sequence split across a context group (``hybrid.planning.context`` says which chunks
each rank holds).

Attention runs block by block. Rank ``r``'s queries meet the keys and values of every rank of
the group; each pair of a query chunk ``a`` and a key chunk ``c`` is either skipped (``c > a``:
all in the future), causal (``c == a``) or full (``c < a``). Each block gives its output and the
log-sum-exp of its scores, and blocks merge exactly (an online softmax), so the result is full
causal attention. ``comm="p2p"`` passes each rank's keys and values around the ring, the next
block in flight while the current one is computed; ``comm="allgather"`` gathers them all first.
The backward is written out (``_ContextAttention``): it keeps only q, k, v, the output and the
log-sum-exp, recomputes each block's probabilities, and under p2p sends each block's key and
value gradients on around the ring until they are home.
"""

from __future__ import annotations

from typing import Optional

import torch

from hybrid.comm import Group, Message, RECV, SEND
from hybrid.planning.context import chunk_ids, chunks_per_sequence

_KEY_VALUES, _GRADIENTS = 0, 1
"""Message tags: in the backward keys and values and their gradients travel the ring at once."""


def context_slice(tokens: torch.Tensor, cp: int, rank: int, zigzag: bool = True) -> torch.Tensor:
    """The tokens ``[b, s]`` (or any ``[b, s, ...]``) context rank ``rank`` holds:
    ``[b, s / cp]``, its chunks in sequence order."""
    if cp == 1:
        return tokens.contiguous()
    chunks = tokens.chunk(chunks_per_sequence(cp, zigzag), dim=1)
    return torch.cat([chunks[c] for c in chunk_ids(cp, rank, zigzag)], dim=1).contiguous()


def context_positions(local_seq: int, cp: int, rank: int, device: torch.device,
                      zigzag: bool = True) -> torch.Tensor:
    """The positions in the whole sequence of the ``local_seq`` tokens ``rank`` holds."""
    size = local_seq // len(chunk_ids(cp, rank, zigzag))
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in chunk_ids(cp, rank, zigzag)])


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                window: Optional[int]) -> torch.Tensor:
    """``[sq, sk]`` True where a query may see a key: causal, and with a sliding window (HF's
    ``sliding_window_overlay``) only the ``window - 1`` keys before it and itself."""
    behind = query_positions[:, None] - key_positions[None, :]
    allowed = behind >= 0
    return allowed if window is None else allowed & (behind < window)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                       context) -> torch.Tensor:
    """Causal attention of ``[b, n, s, hd]`` heads within a sliding window -> ``[s, b, n *
    hd]``; ``context`` a block's ``Context``: around its group's ring when it is on."""
    if context.on:
        return context_attention(q, k, v, context.group, comm=context.comm, window=window)
    positions = torch.arange(q.shape[2], device=q.device)
    mask = window_mask(positions, positions, window)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    batch, _, seq, _ = out.shape
    return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, *,
                      comm: str = "p2p", zigzag: bool = True,
                      window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of this rank's ``[b, n, s/cp, hd]`` queries over the whole sequence,
    whose keys and values are split over ``group`` as ``context_slice`` splits tokens;
    returns this rank's output as ``[s/cp, b, n * hd]`` (the layout the output projection
    takes; in the inputs' dtype, computed in fp32). Collective over ``group``: every rank
    calls it for the same layer and micro-batch. ``window``: a sliding window (``window_mask``);
    its blocks run in plain matmuls with the mask of their chunks' positions, and blocks wholly
    outside it are skipped."""
    return _ContextAttention.apply(q, k, v, group, comm, zigzag, window)


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: Group, comm: str, zigzag: bool, window: Optional[int]):
        ring = _Ring(group, zigzag, window)
        out, lse = ring.forward(q.float(), k.float(), v.float(), comm)
        batch, heads, seq, head_dim = out.shape
        out = out.permute(2, 0, 1, 3).reshape(seq, batch, heads * head_dim).to(q.dtype)
        # The output is kept for backward as returned: the projection keeps the same tensor.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.comm = ring, comm
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        seq, batch = out.shape[:2]

        def heads_first(t):  # [s, b, n * hd] -> [b, n, s, hd], like q
            return t.float().view(seq, batch, q.shape[1], q.shape[3]).permute(1, 2, 0, 3)

        dq, dk, dv = ctx.ring.backward(q.float(), k.float(), v.float(), heads_first(out), lse,
                                       heads_first(grad_out), ctx.comm)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class _Ring:
    """One context group's attention: who holds which chunks, the block math, the ring."""

    def __init__(self, group: Group, zigzag: bool, window: Optional[int] = None):
        self.group, self.zigzag, self.window = group, zigzag, window
        self.cp, self.rank = group.size(), group.rank()
        self.chunk_len = 0  # set by forward: the tokens of one chunk

    def chunks(self, rank: int) -> tuple[int, ...]:
        return chunk_ids(self.cp, rank, self.zigzag)

    def pairs(self, source: int):
        """``(query piece, key piece, mask)`` for every block of this rank's queries against
        ``source``'s keys that is not all in the future (nor, with a window, all too far
        behind); the mask is ``True`` (causal), ``False`` (full) or, with a window, the
        block's boolean mask."""
        for i, a in enumerate(self.chunks(self.rank)):
            for j, c in enumerate(self.chunks(source)):
                if c > a:
                    continue
                if self.window is None:
                    yield i, j, c == a
                    continue
                size = self.chunk_len
                nearest = (a - c - 1) * size + 1 if c < a else 0  # the closest pair's distance
                if nearest < self.window:
                    queries = torch.arange(a * size, (a + 1) * size)
                    keys = torch.arange(c * size, (c + 1) * size)
                    yield i, j, window_mask(queries, keys, self.window)

    # ----- forward ---------------------------------------------------------------------------
    def forward(self, q, k, v, comm: str):
        pieces = len(self.chunks(self.rank))
        self.chunk_len = q.shape[2] // pieces
        outs: list[Optional[torch.Tensor]] = [None] * pieces
        lses: list[Optional[torch.Tensor]] = [None] * pieces
        qs = q.chunk(pieces, dim=2)
        for source, kv in self._key_values(torch.stack([k, v]), comm):
            ks, vs = kv[0].chunk(pieces, dim=2), kv[1].chunk(pieces, dim=2)
            for i, j, causal in self.pairs(source):
                block_out, block_lse = _block_forward(qs[i], ks[j], vs[j], causal)
                outs[i], lses[i] = _merge(outs[i], lses[i], block_out, block_lse)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)

    def _key_values(self, kv: torch.Tensor, comm: str):
        """``(source rank, its stacked keys and values)`` for every rank, this one first."""
        if comm == "allgather":
            gathered = torch.empty((self.cp * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype,
                                   device=kv.device)
            self.group.all_gather_into(gathered, kv.contiguous())
            gathered = gathered.view(self.cp, *kv.shape)
            for step in range(self.cp):
                source = (self.rank - step) % self.cp
                yield source, gathered[source]
            return
        for step in range(self.cp):
            pending = self._pass_on(kv) if step < self.cp - 1 else None
            yield (self.rank - step) % self.cp, kv
            if pending is not None:
                kv = _received(pending)

    def _pass_on(self, tensor: torch.Tensor, tag: int = _KEY_VALUES):
        """Send ``tensor`` to the next rank of the ring and receive the previous rank's."""
        buffer = torch.empty_like(tensor)
        ranks = self.group.ranks
        works = self.group.exchange([
            Message(SEND, tensor, ranks[(self.rank + 1) % self.cp], tag),
            Message(RECV, buffer, ranks[(self.rank - 1) % self.cp], tag)])
        return works, buffer, tensor

    # ----- backward --------------------------------------------------------------------------
    def backward(self, q, k, v, out, lse, grad_out, comm: str):
        pieces = len(self.chunks(self.rank))
        qs, dos = q.chunk(pieces, dim=2), grad_out.chunk(pieces, dim=2)
        outs, lses = out.chunk(pieces, dim=2), lse.chunk(pieces, dim=2)
        dqs = [torch.zeros_like(t) for t in qs]
        kv_grads = {}  # allgather: every source's; p2p: the one travelling through this rank
        pending = None
        for source, kv in self._key_values(torch.stack([k, v]), comm):
            ks, vs = kv[0].chunk(pieces, dim=2), kv[1].chunk(pieces, dim=2)
            dkv = torch.zeros_like(kv)
            dks, dvs = dkv[0].chunk(pieces, dim=2), dkv[1].chunk(pieces, dim=2)
            for i, j, causal in self.pairs(source):
                dq, dk, dv = _block_backward(qs[i], ks[j], vs[j], dos[i], outs[i], lses[i],
                                             causal)
                dqs[i] += dq
                dks[j].add_(dk)  # views of dkv: it travels on as one tensor
                dvs[j].add_(dv)
            if comm == "allgather":
                kv_grads[source] = dkv
                continue
            if pending is not None:  # the sum so far of the other ranks' gradients of source
                dkv += _received(pending)
            pending = self._pass_on(dkv, _GRADIENTS)
        if comm == "allgather":
            dkv = torch.empty_like(kv_grads[self.rank])
            stacked = torch.cat([kv_grads[s] for s in range(self.cp)])
            self.group.reduce_scatter_into(dkv, stacked)
        else:
            dkv = _received(pending)  # this rank's own, complete after a full turn
        return torch.cat(dqs, dim=2), dkv[0], dkv[1]


def _received(pending) -> torch.Tensor:
    works, buffer, _sent = pending
    for work in works:
        work.wait()
    return buffer


def _block_forward(q, k, v, causal, fused: Optional[bool] = None):
    """One block's output and log-sum-exp: on CPU torch's fused flash kernel (the one
    ``scaled_dot_product_attention`` runs there), elsewhere, or with a window's mask
    (``causal`` a tensor), the same in plain matmuls (a query row the mask empties gives 0 and
    a log-sum-exp of -inf, which ``_merge`` weighs as nothing)."""
    if isinstance(causal, torch.Tensor):
        scores = _scores(q, k, causal)
        lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        return torch.exp(scores - safe.unsqueeze(-1)) @ v, lse
    if q.device.type == "cpu" if fused is None else fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), is_causal=causal)
    scores = _scores(q, k, causal)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def _block_backward(q, k, v, grad_out, out, lse, causal, fused: Optional[bool] = None):
    """One block's gradients, given the merged output and log-sum-exp of the whole row (so
    each block's probabilities are its share of the full softmax, as ring attention does)."""
    if not isinstance(causal, torch.Tensor) and (q.device.type == "cpu" if fused is None
                                                 else fused):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
            out.contiguous(), lse.contiguous(), 0.0, causal)
    scale = q.shape[-1] ** -0.5
    probs = torch.exp(_scores(q, k, causal) - lse.unsqueeze(-1))
    delta = (grad_out * out).sum(dim=-1, keepdim=True)  # softmax's backward, per row
    dv = probs.transpose(-1, -2) @ grad_out
    dscores = probs * (grad_out @ v.transpose(-1, -2) - delta)
    return (dscores @ k) * scale, (dscores.transpose(-1, -2) @ q) * scale, dv


def _scores(q, k, causal) -> torch.Tensor:
    """Scaled scores; ``causal``: True (mask the future), False, or a boolean mask of the
    pairs allowed."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if isinstance(causal, torch.Tensor):
        return scores.masked_fill(~causal.to(q.device), float("-inf"))
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _merge(out, lse, block_out, block_lse):
    """Two partial softmax results over disjoint keys -> the result over both."""
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    out = (out * torch.exp(lse - merged).unsqueeze(-1)
           + block_out * torch.exp(block_lse - merged).unsqueeze(-1))
    return out, merged
