"""Llama, the second registered family: rotary positions, pre-RMSNorm, a SwiGLU MLP,
grouped-query attention, no biases, tied or untied embeddings (pure side; the blocks are
``hybrid.model.llama``). Llama 2/3, SmolLM, TinyLlama are this shape; Llama 3.1+, Qwen2/2.5,
Qwen3 and Mistral are its variants (below).

Global parameter names (``b`` the block id 1..L; ``n`` heads, ``k`` kv_heads, ``d`` the head
size ``h/n`` or ``model.head_dim``, ``f`` ffn_hidden)::

    embedding.word_embeddings.weight   [V, h]          split over TP on dim 0
    blocks.{b}.input_norm.weight       [h]             replicated
    blocks.{b}.attention.qkv.weight    [(n + 2k) d, h] dim 0: per key/value group, its
                                                       n/k query heads, its key, its value
    blocks.{b}.attention.proj.weight   [h, n d]        dim 1
    blocks.{b}.mlp_norm.weight         [h]             replicated
    blocks.{b}.mlp.gate.weight         [f, h]          dim 0
    blocks.{b}.mlp.up.weight           [f, h]          dim 0
    blocks.{b}.mlp.down.weight         [h, f]          dim 1
      (an MoE layer, ``model.moe.experts > 0``: ``mlp.router.weight`` and ``mlp.experts.*``
      instead, ``hybrid.planning.models.moe``)
    final_norm.weight                  [h]             replicated
    head.output_layer.weight           [V, h]          dim 0 (untied only)

The fused QKV is laid out per query group as Megatron lays it out, so a contiguous TP slice
holds whole groups: tp must divide kv_heads. The gate and up projections are two matrices,
each split over TP, so a rank holds the gate and up rows of the same ``f/tp`` units.

FLOPs per layer forward (b sequences of s tokens): ``2bsh(n + 2k)d`` (QKV) ``+ 2bshnd``
(output) ``+ 4bs²nd`` (scores and their use) ``+ 6bshf`` (gate, up, down).

Variants, each a ``ModelConfig`` field this spec reads (HF's Llama 3, Qwen2/2.5, Qwen3,
Mistral; ``hybrid.interop.llama_variants``): ``rope_scaling=llama3`` (frequencies only, no
parameters), ``qkv_bias`` (``attention.qkv.bias [(n + 2k) d]``, split with its rows),
``head_dim`` (``d`` other than ``h/n``: the output projection is ``[h, n d]``), ``qk_norm``
(``attention.q_norm.weight``, ``attention.k_norm.weight`` ``[d]``, replicated, their gradient
partial over TP), ``sliding_window`` (a mask, no parameters).
"""

from __future__ import annotations

import math

from hybrid.planning.layout import LayoutError, valid_sizes
from hybrid.planning.models.checks import (check_common_shape, common_tp_sizes, positive,
                                           tp_divides)
from hybrid.planning.models.gpt2 import gpt2_head_activation_bytes
from hybrid.planning.models.layers import LayerSpec, layer_kinds, layer_spec
from hybrid.planning.models.moe import (check_moe_shape, moe_mlp_activation_bytes,
                                        moe_mlp_forward_flops, moe_mlp_specs)
from hybrid.planning.models.registry import BYTES, ModelSpec, register_model
from hybrid.planning.param_spec import (ParamSpec, column_specs, head_specs, named, norm_specs,
                                        row_specs, vocab_matrix)

def check_variant_fields(m) -> None:
    """The Llama 3 / Qwen / Mistral fields: a known rope scaling, positive sizes."""
    if m.rope_scaling not in ROPE_SCALINGS:
        raise LayoutError(f"model.rope_scaling={m.rope_scaling!r} is not supported; choose one "
                          f"of {', '.join(ROPE_SCALINGS)} (yarn, dynamic, longrope, linear are "
                          f"not built)")
    if m.rope_scaling == "llama3" and not (m.rope_factor >= 1 and m.rope_original_positions > 0
                                           and m.rope_high_freq_factor > m.rope_low_freq_factor):
        raise LayoutError(f"model.rope_scaling=llama3 needs rope_factor >= 1, "
                          f"rope_original_positions > 0 and rope_high_freq_factor > "
                          f"rope_low_freq_factor; got {m.rope_factor}, "
                          f"{m.rope_original_positions}, {m.rope_high_freq_factor}, "
                          f"{m.rope_low_freq_factor} (Llama 3.2: 32, 8192, 4, 1)")
    for name in ("head_dim", "sliding_window"):
        if getattr(m, name) is not None:
            positive(f"model.{name}", getattr(m, name))


def _sizes(n: int) -> str:
    return ", ".join(map(str, valid_sizes(n)))


RMS = ("weight",)
"""RMSNorm's parameters: a scale, no bias."""


def qkv_rows(m) -> int:
    """Rows of the fused QKV: every query head, and one key and one value per group."""
    return (m.heads + 2 * m.kv) * m.head_size


ROPE_SCALINGS = ("none", "llama3")
"""``model.rope_scaling``'s values (HF's rope types ``default`` and ``llama3``)."""


def head_norm_specs(m) -> dict:
    """Qwen3's per-head q and k RMSNorm scales ``[head_dim]``: every TP rank holds them whole
    but sees only its heads, so their gradient is a partial sum over TP (as the router's)."""
    return {f"attention.{part}_norm.weight": ParamSpec(name="", shape=(m.head_size,),
                                                     sequence_partial=True)
            for part in ("q", "k")}


def llama_block_params(m, block_id: int, sp: bool) -> dict[str, ParamSpec]:
    h, last = m.hidden, m.layers + 1
    if block_id == 0:
        word = vocab_matrix(m.padded_vocab, m.vocab, h, m.tie_embeddings)
        return named("embedding.", {"word_embeddings.weight": word})
    if block_id == last:
        return head_specs(norm_specs("final_norm", h, sp, RMS), m.padded_vocab, m.vocab, h,
                          m.tie_embeddings)
    if not 0 < block_id < last:
        raise ValueError(f"block_id={block_id} is outside 0..{last}")
    local = {**norm_specs("input_norm", h, sp, RMS),
             **column_specs("attention.qkv", qkv_rows(m), h, bias=m.qkv_bias),
             **row_specs("attention.proj", h, m.heads * m.head_size, sp, bias=False)}
    if m.qk_norm:  # after the projections, as the attention module registers them
        local.update(head_norm_specs(m))
    local.update(norm_specs("mlp_norm", h, sp, RMS))
    spec = layer_spec(m, block_id)
    if spec.moe:
        local.update(moe_mlp_specs(m, spec.shared_ffn))
    else:
        local.update({**column_specs("mlp.gate", m.ffn, h, bias=False),
                      **column_specs("mlp.up", m.ffn, h, bias=False),
                      **row_specs("mlp.down", h, m.ffn, sp, bias=False)})
    return named(f"blocks.{block_id}.", local)


def dense_mlp_flops(m, b: int) -> float:
    return 6 * b * m.seq_len * m.hidden * m.ffn


class Llama(ModelSpec):
    name = "llama"
    doc = "Llama: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases"
    blocks_module, hf_module, hf_model_type = "hybrid.model.llama", "hybrid.interop.llama_family", \
        "llama"
    hf_model_types_also = ("mixtral", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe")
    learned_positions = False  # rotary: the context is no shape of any weight

    def block_params(self, m, block_id, sequence_parallel):
        return llama_block_params(m, block_id, sequence_parallel)

    def layer_forward_flops(self, m, b):
        """The mean over the layers (their kinds mixed: ``models.layers``), so ``layers x``
        this is the model's exact total; ``block_forward_flops`` is one layer's."""
        return sum(n * self._kind_flops(m, b, kind)
                   for kind, n in layer_kinds(m).items()) / m.layers

    def block_forward_flops(self, m, b, block_id):
        return self._kind_flops(m, b, layer_spec(m, block_id))

    def _kind_flops(self, m, b, kind: LayerSpec) -> float:
        s, h = m.seq_len, m.hidden
        mlp = moe_mlp_forward_flops(m, b, kind.shared_ffn) if kind.moe else dense_mlp_flops(m, b)
        return (2 * b * s * h * qkv_rows(m) + 2 * b * s * h * m.heads * m.head_size
                + self.attention_core_flops(m, b) + mlp)

    def attention_core_flops(self, m, b):
        """Scores and their use over every pair, the window's masked ones included (the
        kernels compute them)."""
        return 4 * b * m.seq_len * m.seq_len * m.heads * m.head_size

    def layer_activation_bytes(self, m, micro_batch, tp, sp, precision, recompute="none",
                               cp=1):
        """Tensor by tensor as hybrid's Llama layer keeps them (``tests/test_llama_tp.py``
        checks this against saved-tensor hooks, byte for byte), as GPT-2's layer with these
        differences: each RMSNorm keeps its input, one statistic per token and its normalised
        input (fp32, for the scale's gradient); the rotary ``cos`` and ``sin`` of the rank's
        positions; the rotated query and key and, with ``heads / kv_heads`` > 1, the keys and
        values repeated to every query head (with one, the QKV output holds the values);
        SwiGLU's gate, up, SiLU and product (four ``ffn``-wide tensors). With experts, the
        mean over the layers (``block_activation_bytes``: one layer's), an MoE MLP's bytes
        estimated (``moe.moe_mlp_activation_bytes``)."""
        args = (m, micro_batch, tp, sp, precision, recompute, cp)
        return sum(n * self._kind_bytes(kind, *args)
                   for kind, n in layer_kinds(m).items()) // m.layers

    def block_activation_bytes(self, m, block_id, micro_batch, tp, sp, precision,
                               recompute="none", cp=1):
        return self._kind_bytes(layer_spec(m, block_id), m, micro_batch, tp, sp, precision,
                                recompute, cp)

    def _kind_bytes(self, kind: LayerSpec, m, micro_batch, tp, sp, precision, recompute,
                    cp) -> int:
        s, b, h = m.seq_len // cp, micro_batch, m.hidden
        seq_shard = tp if sp else 1
        stream = 4 * s * b * h // seq_shard
        if recompute == "full":
            return stream
        low = BYTES[precision]
        nbytes = 4 * stream + 2 * 4 * s * b // seq_shard  # inputs, normalised inputs, rstd
        # The normed inputs of QKV and of gate/up, gathered; under autocast gate and up each
        # keep their own bf16 copy of theirs.
        nbytes += (3 if precision == "bf16" else 2) * s * b * h * low
        nbytes += 2 * s * m.head_size * low  # the rotary table's cos and sin
        values = 2 * h if m.heads != m.kv else h + qkv_rows(m)  # keys, values
        nbytes += (h + values + h) * s * b // tp * low  # q, k, v, output
        if kind.moe:
            nbytes += moe_mlp_activation_bytes(m, s * b, tp, precision, kind.shared_ffn)
        else:
            nbytes += 4 * m.ffn * s * b // tp * low
        if recompute == "none" or cp > 1:
            nbytes += 4 * b * (m.heads // tp) * s  # the attention kernel's log-sum-exp
        if precision == "bf16":  # the bf16 weight copies autocast keeps
            mlp = 3 * h * (m.moe.experts * m.moe_ffn + kind.shared_ffn if kind.moe else m.ffn)
            nbytes += 2 * (qkv_rows(m) * h + h * h + mlp) // tp
        return nbytes

    def head_activation_bytes(self, m, micro_batch, tp, sp, precision, cp=1):
        """GPT-2's head's, with an RMSNorm: its normalised input instead of a second
        statistic per token."""
        s, b, h = m.seq_len // cp, micro_batch, m.hidden
        rms = (4 * s * b * h - 4 * s * b) // (tp if sp else 1)
        return gpt2_head_activation_bytes(m, micro_batch, tp, sp, precision, cp) + rms

    def check_shape(self, m, tp):
        if m.kv_heads is not None:
            positive("model.kv_heads", m.kv_heads)
        check_common_shape(m, tp, lambda: self.valid_tp_sizes(m))
        if m.heads % m.kv:
            raise LayoutError(f"model.kv_heads={m.kv} does not divide model.heads={m.heads}; "
                              f"choose kv_heads in {{{_sizes(m.heads)}}}")
        tp_divides(tp, "model.kv_heads", m.kv, lambda: self.valid_tp_sizes(m))
        check_moe_shape(m, tp, lambda: self.valid_tp_sizes(m))
        if not math.isfinite(m.rope_base) or m.rope_base <= 1:
            raise LayoutError(f"model.rope_base={m.rope_base} must be a finite number > 1 (the "
                              f"rotary angles' base, HF's rope_theta: 10000 or 500000)")
        if m.head_size % 2:
            raise LayoutError(f"the head size {m.head_size} (model.head_dim, or model.hidden="
                              f"{m.hidden} / model.heads={m.heads}) is odd; rotary positions "
                              f"rotate pairs of a head's dimensions: choose an even head size")
        check_variant_fields(m)

    def valid_tp_sizes(self, m):
        return [d for d in common_tp_sizes(m)
                if m.kv % d == 0 and (m.moe.experts == 0 or m.moe_ffn % d == 0)
                and (m.moe.experts == 0 or m.moe.shared_ffn_hidden % d == 0)]


LLAMA = register_model(Llama())
