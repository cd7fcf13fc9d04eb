"""Context parallelism's plan (pure: no torch): which chunks of a sequence each rank of a
context group holds, and the rules a layout with ``cp > 1`` must follow.

A sequence of ``s`` tokens is cut into ``2 * cp`` equal chunks and rank ``r`` of the context
group holds chunks ``r`` and ``2 * cp - 1 - r`` (the zigzag of Megatron's and Transformer
Engine's context parallelism): under a causal mask the early chunk has little to attend to and
the late one much, so every rank does the same work. Without zigzag (``cp`` chunks, rank ``r``
holding chunk ``r``) the last rank does ``2 * cp - 1`` times the first rank's work; the
attention supports both, training uses zigzag.
"""

from __future__ import annotations

from typing import Optional

CP_COMMS = ("p2p", "allgather")
"""How keys and values reach every rank of a context group: passed around the ring block by
block, overlapped with each block's attention (``p2p``), or all-gathered at once."""


def chunk_ids(cp: int, rank: int, zigzag: bool = True) -> tuple[int, ...]:
    """The chunks of a sequence that context rank ``rank`` holds, in sequence order."""
    if not 0 <= rank < cp:
        raise ValueError(f"context rank {rank} is outside 0..{cp - 1}")
    return (rank, 2 * cp - 1 - rank) if zigzag else (rank,)


def chunks_per_sequence(cp: int, zigzag: bool = True) -> int:
    return 2 * cp if zigzag else cp


def local_positions(seq: int, cp: int, rank: int, zigzag: bool = True) -> list[int]:
    """The positions (0-based, of the whole sequence) of the tokens ``rank`` holds."""
    size = seq // chunks_per_sequence(cp, zigzag)
    return [c * size + i for c in chunk_ids(cp, rank, zigzag) for i in range(size)]


def context_problem(seq_len: int, parallel) -> Optional[str]:
    """The first reason ``parallel`` (a ``ParallelConfig``) cannot split sequences of
    ``seq_len`` tokens over its context group, as one line, or None."""
    cp, tp = parallel.cp, parallel.tp
    if parallel.cp_comm not in CP_COMMS:
        return f"parallel.cp_comm={parallel.cp_comm!r} is not one of {', '.join(CP_COMMS)}"
    if cp == 1:
        return None
    if seq_len % (2 * cp):
        fits = ", ".join(str(c) for c in range(1, cp + 1) if seq_len % (2 * c) == 0)
        return (f"parallel.cp={cp} needs model.seq_len={seq_len} divisible by 2*cp={2 * cp} "
                f"(each rank holds two of 2*cp equal chunks); use cp in {{{fits}}} or a "
                f"seq_len that is a multiple of {2 * cp}")
    if parallel.sequence_parallel and (seq_len // cp) % tp:
        return (f"parallel.sequence_parallel=true with parallel.cp={cp} needs each rank's "
                f"{seq_len // cp} tokens divisible by parallel.tp={tp}; change seq_len, cp or tp")
    if parallel.dp_sync_every > 1:
        return (f"parallel.dp_sync_every={parallel.dp_sync_every} lets replicas step apart, but "
                f"the ranks of a context group hold parts of the same sequences and must step "
                f"together: use parallel.cp=1 or parallel.dp_sync_every=1")
    return None
