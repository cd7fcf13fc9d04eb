"""A key/value cache for generation on the 1-process model: each attention layer keeps the
keys and values of the tokens it has seen, so the next token's forward computes only its own.

Used only under ``torch.no_grad`` by ``GPT.decode`` (``hybrid.generate``): first the prompt
(the cache empty: causal attention over it), then one token at a time (attending to every
cached token). Training never passes a cache: its forward is unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hybrid.model.context import window_mask


class LayerCache:
    """One attention layer's keys and values ``[b, n, t, hd]`` so far."""

    def __init__(self) -> None:
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: Optional[int] = None) -> torch.Tensor:
        """Attention of the new tokens' ``[b, n, s, hd]`` heads over the cached and new keys
        -> ``[s, b, n * hd]``; the new keys and values are kept. ``window``: a sliding window
        (Mistral's): each token sees itself and the ``window - 1`` tokens before it."""
        if self.keys is None:
            self.keys, self.values = k, v
            if window is not None and window < q.shape[2]:
                positions = torch.arange(q.shape[2], device=q.device)
                mask = window_mask(positions, positions, window)
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                return _tokens_first(context)
            causal = True
        else:
            assert q.shape[2] == 1, "after the prompt the cache takes one token at a time"
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
            causal = False  # the one new token sees every earlier one (in its window)
        keys, values = self.keys, self.values
        if not causal and window is not None:
            keys, values = keys[:, :, -window:], values[:, :, -window:]
        return _tokens_first(F.scaled_dot_product_attention(q, keys, values, is_causal=causal))


def _tokens_first(context: torch.Tensor) -> torch.Tensor:
    """``[b, n, s, hd]`` -> ``[s, b, n * hd]``."""
    batch, _, seq, _ = context.shape
    return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)


class KVCache:
    """Every layer's cache, and how many tokens they hold (the new tokens' first position)."""

    def __init__(self, layers: int) -> None:
        self.layers = [LayerCache() for _ in range(layers)]
        self.length = 0
