"""A tiny random Llama 3.2-shaped HF model, saved as the hub ships Llama 3.2: shards, their
index, ``config.json`` (``rope_scaling`` of type ``llama3``, tied embeddings, grouped-query
attention) and a ``tokenizer.json``. It stands in for a downloaded model where nothing can be
downloaded (docs/models.md's walkthrough, run by ``tests/test_models_docs.py``)::

    python -m hybrid.interop.tiny_hf OUT [--shard-size 100kB]

Needs ``transformers`` (the ``test`` extra). The tokenizer is a byte-level BPE of 512 ids
trained on CPython's documentation, end of document ``<|endoftext|>`` (id 0).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
             rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
"""Llama 3.2's rope scaling, its original context scaled down with the model."""


def save_tiny_llama(out: Path, shard_size: str = "100kB", seed: int = 0) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pydoc_data.topics
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybrid.data.tokenizer import GPT2_EOD, train_byte_level_bpe

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters=dict(ROPE)))
    model.save_pretrained(out, max_shard_size=shard_size)
    texts = list(pydoc_data.topics.topics.values())
    train_byte_level_bpe(texts, SHAPE["vocab_size"]).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": GPT2_EOD}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="folder to write (must not exist)")
    parser.add_argument("--shard-size", default="100kB", help="largest shard (HF's units)")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"error: {out} exists; choose a new folder")
    save_tiny_llama(out, args.shard_size)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    print(f"wrote a tiny Llama 3.2-shaped model to {out}: {len(files)} shards, "
          f"tokenizer.json")


if __name__ == "__main__":
    main()
