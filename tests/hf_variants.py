"""Tiny random HF models of the llama family's variants, built offline and saved locally:
Llama 3.2 (rope_scaling llama3, tied), Qwen2 (q/k/v biases), Qwen3 (head_dim other than
hidden/heads, q/k norms), Mistral (a sliding window shorter than the sequence)."""

from pathlib import Path

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
             rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
"""A llama3 rope whose three bands (kept, blended, slowed) all hold frequencies of a head of
8 at 32 original positions, so a wrong band shows within the test's 32 tokens."""
WINDOW = 8


def variant_configs() -> dict:
    """name -> (HF causal-LM class, its config): one model per variant."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    return {
        "llama3.2": (LlamaForCausalLM, LlamaConfig(**SHAPE, tie_word_embeddings=True,
                                                   rope_parameters=dict(LLAMA3_ROPE))),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, tie_word_embeddings=False)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True)),
        "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=WINDOW,
                                                      tie_word_embeddings=False)),
    }


def make_variant_dir(path: Path, name: str, seed: int = 0, tokenizer: bool = True) -> Path:
    """Variant ``name`` saved with ``save_pretrained`` (one file), every parameter drawn (no
    unit norm or zero bias that would hide a misplaced tensor); with ``hf_models``' byte-level
    BPE (end of document: id 0)."""
    import torch

    from hf_models import save_byte_level_bpe

    hf_class, config = variant_configs()[name]
    torch.manual_seed(seed)
    model = hf_class(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    if tokenizer:
        save_byte_level_bpe(path, SHAPE["vocab_size"])
    return path
