"""Generation with the key/value cache gives the same ids as recomputing the prefix every
token, for both families (untied, tied, grouped-query), through the prompt, the single-token
steps and past ``seq_len`` (where the window slides and the cache stops)."""

import pytest
import torch

from hybrid.generate import Source, generate, one_process_model
from hybrid.planning.config import ModelConfig

pytestmark = pytest.mark.timeout(180)

MODELS = {
    "gpt2": ModelConfig(layers=2, hidden=32, heads=4, vocab=120, seq_len=24),
    "gpt2-tied": ModelConfig(layers=2, hidden=32, heads=4, vocab=120, seq_len=24,
                             tie_embeddings=True),
    "llama-gqa": ModelConfig(family="llama", layers=2, hidden=32, heads=4, kv_heads=2,
                             ffn_hidden=48, vocab=120, seq_len=24),
    "llama-mha": ModelConfig(family="llama", layers=2, hidden=32, heads=4, vocab=120,
                             seq_len=24, tie_embeddings=True),
}


def _weights(model_cfg: ModelConfig) -> dict:
    """Random global weights large enough that greedy choices vary."""
    from hybrid.planning.params import model_param_specs

    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(spec.shape, generator=gen) * 0.3
            for name, spec in model_param_specs(model_cfg).items()}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_cache_changes_no_id(name, temperature):
    cfg = MODELS[name]
    source = Source(cfg, _weights(cfg), None, None, "test")
    prompt = [5, 17, 42, 3, 99]
    with one_process_model(source) as model:
        ids = [generate(model, prompt, max_new_tokens=30, temperature=temperature, top_k=0,
                        seed=1, eod=None, cache=cache) for cache in (True, False)]
    assert ids[0] == ids[1] and len(ids[0]) == 30  # 5 + 30 > seq_len 24: past it too
    assert temperature == 0 or len(set(ids[0])) > 3
