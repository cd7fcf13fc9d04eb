"""The Qwen2-MoE / Qwen3-MoE config mapping (``hybrid.interop.qwen_moe``, docs/moe.md), pure:
``mlp_only_layers`` and ``decoder_sparse_step`` as hybrid's dense-layer list and back, the
model_type export picks, and the one-line refusals. The tensors and the logits against
transformers are ``test_qwen_moe_hf``'s (slow)."""

from dataclasses import replace

import pytest

from hybrid.interop import llama_family, mixtral, qwen_moe
from hybrid.interop.hf_dir import ConversionError
from hybrid.planning.config import ModelConfig

CONFIG = dict(model_type="qwen2_moe", hidden_size=32, intermediate_size=64, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
              max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=48, shared_expert_intermediate_size=40,
              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False)


def model_of(**changes) -> ModelConfig:
    fields = llama_family.model_fields({**CONFIG, **changes}, "src")
    return replace(ModelConfig(), family="llama", **fields)


@pytest.mark.parametrize("step, only, dense", [
    (1, [], []), (1, [0], [1]), (2, [], [1, 3, 5]), (2, [3], [1, 3, 4, 5]), (3, [0, 1], [1, 2, 4, 5]),
])
def test_sparse_layers_come_in_as_a_dense_list_and_go_back_out_as_they_came(step, only, dense):
    model = model_of(decoder_sparse_step=step, mlp_only_layers=only)
    assert model.moe_every == 1 and model.moe_dense_layers == dense
    assert qwen_moe.sparse_step(model) == (step, [i for i in only if (i + 1) % step == 0])
    config = llama_family.hf_config(model)
    assert (config["model_type"], config["norm_topk_prob"], config["qkv_bias"]) == \
        ("qwen2_moe", False, True)


def test_export_picks_mixtral_or_qwen_by_what_the_model_has():
    mixtral_like = replace(ModelConfig(), family="llama", experts=4)
    assert llama_family._of_model(mixtral_like) is mixtral
    assert llama_family._of_model(replace(mixtral_like, moe_dense_layers=[1],
                                          qk_norm=True)) is qwen_moe
    assert qwen_moe.model_type(replace(mixtral_like, qk_norm=True)) == "qwen3_moe"
    assert qwen_moe.model_type(mixtral_like.with_moe(shared_ffn_hidden=8)) == "qwen2_moe"


@pytest.mark.parametrize("changes, needle", [
    ({"use_sliding_window": True}, "use_sliding_window=True cannot be converted"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0: hybrid "
                                             "converts Qwen2-MoE with its shared expert"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be an integer >= 1"),
])
def test_what_hybrid_cannot_import_is_one_line(changes, needle):
    with pytest.raises(ConversionError) as err:
        model_of(**changes)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_model_neither_mixtral_nor_qwen_holds_is_refused_on_export():
    model = replace(ModelConfig(), family="llama", experts=4, moe_dense_layers=[1])
    with pytest.raises(ConversionError, match="no shared expert and no q/k norms has no HF "
                                              "model_type.*--format torch"):
        llama_family.hf_config(model)
