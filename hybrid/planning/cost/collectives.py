"""The time of a ring collective over one link (pure arithmetic)."""

from __future__ import annotations

from hybrid.planning.cost.devices import Link

BUCKET_BYTES = 25 * 2**20
"""DP gradient buckets (``parallel.bucket_mb``'s default order of size): one latency each."""


def ring_all_reduce(nbytes: float, n: int, link: Link, messages: int = 1) -> float:
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency * messages


def ring_gather(nbytes: float, n: int, link: Link, messages: int = 1) -> float:
    """A reduce-scatter or an all-gather of ``nbytes`` in total."""
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency * messages
