"""The work of a transformer layer that no multiply counts (pure: no torch): the element-wise,
memory-bound kernels (norms, bias adds, GeLU, dropout, residual adds, and where the software
materialises them the attention scores' softmax and dropout), each priced as the bytes it moves
at the device's memory bandwidth, plus a fixed cost per kernel launched (``kernel_s``); and the
accumulation of each micro-batch's weight gradients into the step's.

Bytes per token of one layer, in activation elements of ``e`` bytes (bf16: 2) unless marked:

- outside the TP regions (every TP rank does it whole, unless sequence parallelism shards it):
  forward, two norms (read, write: ``2h`` each) and two fused bias-dropout-residual adds (read
  two, write one, and a one-byte mask: ``3h`` and ``h`` bytes each); backward, the two adds'
  gradients (read, mask, write, and the bias gradient's read: ``3h`` and ``h`` bytes each),
  the norms' (read input and gradient, write, and read both again for the weight gradient:
  ``5h`` each), and the residual branches' gradient sums (``3h`` each);
- inside them (``/ tp``): the MLP's activation over ``f`` (fused bias and GeLU: read, write;
  backward: read input and gradient, write, and the bias gradient's read);
- the attention scores, only where the software writes them out (``unfused_attention``:
  Megatron-LM's scale-mask-softmax and dropout over ``b·(a/tp)·s²`` scores; hybrid's own layer
  runs a fused kernel that keeps none): forward softmax (read, write) and dropout (read, write,
  a one-byte mask); backward the same two in reverse (dropout: read, mask, write; softmax:
  read its output and gradient, write); and with them Megatron-LM's attention block's own
  passes: the QKV bias added apart from its multiply, the context's copy back to tokens-first,
  and the concatenation that is the backward of splitting Q, K and V (``layer_traffic``).

Full recompute runs the forward's traffic once more; selective recompute the scores' part.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.planning.config import Config, ModelConfig
from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.flops import attention_core_flops, layer_forward_flops
from hybrid.planning.models import BYTES

FORWARD_KERNELS = 13
"""Kernels one layer's forward launches: six multiplies (QKV, scores, their use, projection,
two MLP), two norms, two bias-dropout-adds, the MLP activation, softmax and dropout (or one
fused attention kernel and two layout copies)."""
BACKWARD_KERNELS = 26
"""Twice the multiplies (input and weight gradients) and the element-wise kernels' backward."""
ACCUMULATE_BYTES_PER_PARAM = 12
"""Adding a micro-batch's fp32 weight gradient into the step's: read both, write one."""


@dataclass(frozen=True)
class LayerTraffic:
    """One layer, one micro-batch, one TP rank: bytes moved by memory-bound kernels."""

    forward: float
    backward: float
    scores_forward: float
    """Of ``forward``, the attention scores' part (what selective recompute runs again)."""
    score_matmuls: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) bytes the attention core's batched multiplies move through the
    written-out scores (forward: the scores written, the probabilities read; backward: four
    such passes): with heads of 128 or fewer channels they are memory-bound, and take the
    longer of these bytes' time and their FLOPs' (a roofline)."""


def layer_traffic(m: ModelConfig, b: int, tp: int, cp: int, sp: bool, precision: str,
                  unfused_attention: bool) -> LayerTraffic:
    """The bytes of the module doc for ``b`` sequences of ``seq_len / cp`` tokens."""
    e = BYTES[precision]
    tokens = b * m.seq_len / cp
    outside = tokens / (tp if sp else 1)
    h, f = m.hidden, m.ffn
    forward = outside * (2 * (2 * e * h) + 2 * (3 * e * h + h))
    backward = outside * (2 * (3 * e * h + h) + 2 * 5 * e * h + 2 * 3 * e * h)
    forward += tokens * 2 * e * f / tp
    backward += tokens * 4 * e * f / tp
    scores = 0.0
    if unfused_attention:
        # Megatron-LM's attention block: the QKV bias added apart from its multiply (PyTorch's
        # F.linear on 3-D input: read, write 3h; backward: the bias gradient's read), the
        # context copied from heads-first back to tokens-first (read, write h each way), and
        # the backward of splitting QKV into three views, a concatenation (read, write 3h)
        forward += tokens * (2 * 3 * e * h + 2 * e * h) / tp
        backward += tokens * (3 * e * h + 2 * e * h + 2 * 3 * e * h) / tp
        per_score = b * (m.heads / tp) * m.seq_len * m.seq_len / cp
        scores = per_score * (4 * e + 1)
        backward += per_score * (5 * e + 1)
        return LayerTraffic(forward=forward + scores, backward=backward, scores_forward=scores,
                            score_matmuls=(per_score * 2 * e, per_score * 4 * e))
    return LayerTraffic(forward=forward, backward=backward, scores_forward=0.0)


def layer_params(m: ModelConfig) -> float:
    """A layer's weights, from its FLOPs (two per weight and token, attention's core aside)."""
    return (layer_forward_flops(m, 1) - attention_core_flops(m, 1)) / (2 * m.seq_len)


def head_traffic(m: ModelConfig, b: int, tp: int, cp: int) -> tuple[float, float]:
    """(forward, backward) bytes of the vocabulary-parallel cross entropy on one TP rank: the
    logits read in bf16 and worked in fp32 (maximum, exponentials, their sum, the loss:
    about four fp32 passes forward, three backward)."""
    logits = b * m.seq_len / cp * m.padded_vocab / tp
    return logits * (2 + 4 * 4), logits * 3 * 4


@dataclass(frozen=True)
class StageBound:
    """Memory-bound seconds of one micro-batch on one stage (``memory_bound``)."""

    forward: float = 0.0
    backward: float = 0.0
    scores: float = 0.0
    """The attention scores' forward share (selective recompute's)."""


def stage_memory_bound(cfg: Config, tp: int, cp: int, device: Device, blocks: range,
                       layers: int, attention_s: float) -> StageBound:
    """The element-wise kernels' bytes at the device's memory bandwidth and every kernel's
    fixed cost (the layers', the head's cross entropy; ``layers`` of ``blocks``, on a rank of
    ``tp`` x ``cp``), the accumulation of the stage's weight gradients, and where the attention core's multiplies are memory-bound what their
    bytes take beyond their FLOPs (``attention_s``: one layer's, forward); nothing where the
    device prices none (a calibrated CPU)."""
    if not device.memory_bandwidth:
        return StageBound()
    m, b, bw = cfg.model, cfg.train.micro_batch, device.memory_bandwidth
    traffic = layer_traffic(m, b, tp, cp, cfg.parallel.sequence_parallel, cfg.train.precision,
                            device.unfused_attention)
    score_forward, score_backward = (nbytes / bw for nbytes in traffic.score_matmuls)
    roofline_forward = max(0.0, score_forward - attention_s)
    roofline_backward = max(0.0, score_backward - 2 * attention_s)
    forward = layers * (traffic.forward / bw + FORWARD_KERNELS * device.kernel_s
                        + roofline_forward)
    backward = layers * (traffic.backward / bw + BACKWARD_KERNELS * device.kernel_s
                         + roofline_backward)
    params = layers * layer_params(m) / tp
    if m.layers + 1 in blocks:
        head_forward, head_backward = head_traffic(m, b, tp, cp)
        forward += head_forward / bw
        backward += head_backward / bw
        params += m.hidden * m.padded_vocab / tp
    backward += params * (device.grad_accumulate_bytes or ACCUMULATE_BYTES_PER_PARAM) / bw
    return StageBound(forward=forward, backward=backward,
                  scores=layers * (traffic.scores_forward / bw + roofline_forward))
