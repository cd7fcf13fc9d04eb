"""GPT-2, the first registered family: learned positions, pre-LayerNorm, tanh-GELU MLP,
multi-head attention, biases, optionally tied embeddings (pure side; the blocks are
``hybrid.model.blocks``, the HF name map ``hybrid.interop.gpt2``).

Global parameter names, the same on every layout (``b`` is the block id: 1..L for layers)::

    embedding.word_embeddings.weight      [V, h]   split over TP on dim 0 (V: padded vocab)
    embedding.position_embeddings         [s, h]   replicated
    blocks.{b}.input_norm.{weight,bias}   [h]      replicated
    blocks.{b}.attention.qkv.{weight,bias} [3h, h], [3h]  dim 0
    blocks.{b}.attention.proj.weight      [h, h]   dim 1;  .bias [h] replicated
    blocks.{b}.mlp_norm.{weight,bias}     [h]      replicated
    blocks.{b}.mlp.fc1.{weight,bias}      [f, h], [f]  dim 0
    blocks.{b}.mlp.fc2.weight             [h, f]   dim 1;  .bias [h] replicated
    final_norm.{weight,bias}              [h]      replicated
    head.output_layer.weight              [V, h]   dim 0 (untied only; tied, the head uses
                                                   embedding.word_embeddings.weight)

FLOPs per layer and micro-batch (forward, b sequences of s tokens, hidden h, MLP f):
``8bsh² + 4bs²h + 4bshf`` (QKV and output projections, scores and their use, the MLP).
"""

from __future__ import annotations

from hybrid.planning.layout import LayoutError
from hybrid.planning.models.checks import check_common_shape, common_tp_sizes
from hybrid.planning.models.registry import BYTES, ModelSpec, register_model
from hybrid.planning.param_spec import (ParamSpec, column_specs, head_specs, named, norm_specs,
                                        row_specs, vocab_matrix)


def gpt2_block_params(m, block_id: int, sp: bool) -> dict[str, ParamSpec]:
    """GPT-2's table; ``sp``: whether the model is built with sequence parallelism."""
    h, last = m.hidden, m.layers + 1
    # In the order the block's named_parameters() yields them (a module's own parameters
    # before its submodules'): the gradient buckets, and so ZeRO's shards, follow it.
    if block_id == 0:
        position = ParamSpec(name="", shape=(m.seq_len, h))
        word = vocab_matrix(m.padded_vocab, m.vocab, h, m.tie_embeddings)
        return named("embedding.", {"position_embeddings": position,
                                    "word_embeddings.weight": word})
    if block_id == last:
        return head_specs(norm_specs("final_norm", h, sp), m.padded_vocab, m.vocab, h,
                          m.tie_embeddings)
    if not 0 < block_id < last:
        raise ValueError(f"block_id={block_id} is outside 0..{last}")
    local = {**norm_specs("input_norm", h, sp), **column_specs("attention.qkv", 3 * h, h),
             **row_specs("attention.proj", h, h, sp), **norm_specs("mlp_norm", h, sp),
             **column_specs("mlp.fc1", m.ffn, h), **row_specs("mlp.fc2", h, m.ffn, sp)}
    return named(f"blocks.{block_id}.", local)


def gpt2_head_activation_bytes(m, micro_batch: int, tp: int, sp: bool, precision: str,
                               cp: int = 1) -> int:
    """What the head and loss keep per micro-batch: the final norm's input and statistics,
    the gathered normed input of the output layer, the cross entropy's fp32 softmax over this
    rank's vocabulary shard with its target mask and indices (and a bf16 copy of the output
    weight under autocast), for this rank's ``seq_len / cp`` tokens."""
    s, b, h = m.seq_len // cp, micro_batch, m.hidden
    seq_shard = tp if sp else 1
    low = BYTES[precision]
    nbytes = (4 * s * b * h + 2 * 4 * s * b) // seq_shard + s * b * h * low
    nbytes += 4 * s * b * m.padded_vocab // tp + s * b * (1 + 8)
    if precision == "bf16":
        nbytes += 2 * m.padded_vocab // tp * h
    return nbytes


class Gpt2(ModelSpec):
    name, doc = "gpt2", "GPT-2: learned positions, LayerNorm, GELU MLP, multi-head attention"
    blocks_module, hf_module, hf_model_type = "hybrid.model.blocks", "hybrid.interop.gpt2", "gpt2"

    def block_params(self, m, block_id, sequence_parallel):
        return gpt2_block_params(m, block_id, sequence_parallel)

    def layer_forward_flops(self, m, b):
        s, h = m.seq_len, m.hidden
        return 8 * b * s * h * h + self.attention_core_flops(m, b) + 4 * b * s * h * m.ffn

    def attention_core_flops(self, m, b):
        return 4 * b * m.seq_len * m.seq_len * m.hidden

    def layer_activation_bytes(self, m, micro_batch, tp, sp, precision, recompute="none",
                               cp=1):
        """Tensor by tensor as hybrid's layer keeps them (``tests/test_model_tp.py`` checks
        this against saved-tensor hooks, byte for byte). Unlike Korthikanti et al. 2022's eq.
        2, no attention scores: the fused attention kernel keeps only a log-sum-exp per head
        and token, so selective recompute saves just that here.

        fp32: the residual stream twice (the two norms' inputs; sharded by sequence
        parallelism) and their statistics; the two normed inputs of the column-parallel
        matmuls, gathered to the full sequence; the QKV output, the attention output, the
        MLP's two ``ffn``-wide tensors (sharded by TP). bf16 autocast keeps the matmul inputs
        and outputs in bf16, plus a bf16 copy of the layer's matmul weights per micro-batch.
        Full recompute keeps the input. Context parallelism keeps the same per token, for
        this rank's ``seq_len / cp`` tokens (its attention, too, keeps only the output and a
        log-sum-exp: ``hybrid.model.context``)."""
        s, b, h = m.seq_len // cp, micro_batch, m.hidden
        seq_shard = tp if sp else 1
        stream = 4 * s * b * h // seq_shard
        if recompute == "full":
            return stream
        low = BYTES[precision]
        nbytes = 2 * stream + 2 * 2 * 4 * s * b // seq_shard  # + two norms' mean and rstd
        nbytes += 2 * s * b * h * low  # the normed inputs of QKV and fc1
        nbytes += (4 * h + 2 * m.ffn) * s * b // tp * low
        if recompute == "none" or cp > 1:  # context attention is never recomputed selectively
            nbytes += 4 * b * (m.heads // tp) * s  # the attention kernel's log-sum-exp
        if precision == "bf16":
            nbytes += 2 * (4 * h * h + 2 * h * m.ffn) // tp
        return nbytes

    def head_activation_bytes(self, m, micro_batch, tp, sp, precision, cp=1):
        return gpt2_head_activation_bytes(m, micro_batch, tp, sp, precision, cp)

    def check_shape(self, m, tp):
        check_common_shape(m, tp, lambda: self.valid_tp_sizes(m))
        if m.kv_heads is not None and m.kv_heads != m.heads:
            raise LayoutError(f"model.kv_heads={m.kv_heads} asks for grouped-query attention, "
                              f"which model.family={self.name} has not; set model.kv_heads=null "
                              f"or model.family=llama")
        if m.moe.experts:
            raise LayoutError(f"model.moe.experts={m.moe.experts} asks for a mixture of experts, which "
                              f"model.family={self.name} has not; set model.moe.experts=0 or "
                              f"model.family=llama")

    def valid_tp_sizes(self, m):
        return common_tp_sizes(m)


GPT2 = register_model(Gpt2())
