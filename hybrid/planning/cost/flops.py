"""Model FLOPs per micro-batch and per step (pure arithmetic).

FLOPs per layer and micro-batch (forward, b sequences of s tokens, hidden h, MLP f):
``8bsh² + 4bs²h + 4bshf`` (QKV and output projections, scores and their use, the MLP); the
head ``2bshV``; backward twice the forward; full recompute one more forward of the layers,
selective recompute one more of their attention cores (``4bs²h``).
"""

from __future__ import annotations

from hybrid.planning.config import Config, ModelConfig


def layer_forward_flops(m: ModelConfig, b: int) -> float:
    s, h = m.seq_len, m.hidden
    return 8 * b * s * h * h + attention_core_flops(m, b) + 4 * b * s * h * m.ffn


def attention_core_flops(m: ModelConfig, b: int) -> float:
    """Scores and their use (``QK^T`` and ``softmax·V``): what selective recompute redoes."""
    return 4 * b * m.seq_len * m.seq_len * m.hidden


def head_forward_flops(m: ModelConfig, b: int) -> float:
    return 2 * b * m.seq_len * m.hidden * m.padded_vocab


def model_flops_per_step(cfg: Config) -> float:
    """Narayanan et al. 2021, Eq. 3 generalised to any MLP width: layers 3x forward (4x with
    full recompute), the head 3x."""
    m, batch = cfg.model, cfg.train.global_batch
    passes = 4 if m.recompute == "full" else 3
    return (passes * m.layers * layer_forward_flops(m, batch)
            + 3 * head_forward_flops(m, batch))
