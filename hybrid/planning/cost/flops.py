"""Model FLOPs per micro-batch and per step (pure arithmetic).

A layer's forward FLOPs and its attention core's are its family's (``hybrid.planning.models``;
GPT-2: ``8bsh² + 4bs²h + 4bshf`` per micro-batch of b sequences of s tokens); the head
``2bshV``; backward twice the forward; full recompute one more forward of the layers,
selective recompute one more of their attention cores (``4bs²h``).

Three counts per step, for three uses:

- ``model_flops_per_step``: what MFU divides (PaLM's appendix B: 6N per token plus attention's
  12·L·h·s), the model's work alone: the real vocabulary, no recompute. A function of the
  config only, so the same number on every layout (a parallel dimension cannot inflate it);
- ``hardware_flops_per_step``: what the ranks compute: the padded vocabulary and recompute's
  extra forwards (HFU);
- ``paper_flops_per_step``: Narayanan et al. 2021's Eq. 3 (the padded vocabulary, full
  recompute's forward counted, selective's not, as Korthikanti et al. 2022 count): the cost
  model's predicted TFLOP/s, comparable with those papers' tables.
"""

from __future__ import annotations

from hybrid.planning.config import Config, ModelConfig
from hybrid.planning.models import model_spec


def layer_forward_flops(m: ModelConfig, b: int) -> float:
    """One layer's forward over ``b`` sequences, as its family counts it."""
    return model_spec(m).layer_forward_flops(m, b)


def block_forward_flops(m: ModelConfig, b: int, block_id: int) -> float:
    """Layer ``block_id``'s forward over ``b`` sequences: its kind's (dense or MoE layers
    differ: ``hybrid.planning.models.layers``)."""
    return model_spec(m).block_forward_flops(m, b, block_id)


def attention_core_flops(m: ModelConfig, b: int) -> float:
    """Scores and their use (``QK^T`` and ``softmax·V``): what selective recompute redoes."""
    return model_spec(m).attention_core_flops(m, b)


def head_forward_flops(m: ModelConfig, b: int, vocab: int | None = None) -> float:
    """The head's forward over ``vocab`` columns (default: the padded vocabulary it runs)."""
    return 2 * b * m.seq_len * m.hidden * (m.padded_vocab if vocab is None else vocab)


def paper_flops_per_step(cfg: Config) -> float:
    """Narayanan et al. 2021, Eq. 3 generalised to any MLP width: layers 3x forward (4x with
    full recompute), the head 3x."""
    m, batch = cfg.model, cfg.train.global_batch
    passes = 4 if m.recompute == "full" else 3
    return (passes * m.layers * layer_forward_flops(m, batch)
            + 3 * head_forward_flops(m, batch))


def model_flops_per_step(cfg: Config) -> float:
    """MFU's FLOPs: forward and backward of the layers and of the head over the real
    vocabulary; no recompute (see the module doc)."""
    m, batch = cfg.model, cfg.train.global_batch
    return 3 * (m.layers * layer_forward_flops(m, batch)
                + head_forward_flops(m, batch, vocab=m.vocab))


def hardware_flops_per_step(cfg: Config) -> float:
    """What the ranks compute: the padded head, and recompute's extra forward work."""
    m, batch = cfg.model, cfg.train.global_batch
    extra = {"full": layer_forward_flops(m, batch), "selective": attention_core_flops(m, batch),
             "none": 0.0}[m.recompute]
    return (3 * (m.layers * layer_forward_flops(m, batch) + head_forward_flops(m, batch))
            + m.layers * extra)
