"""Tiny random HF GPT-2 directories for the conversion tests, built and saved locally (nothing
downloads: HF's offline switches are set before transformers is imported)."""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SHAPE = dict(n_layer=4, n_embd=32, n_head=4, n_positions=32, vocab_size=300)
"""model=tiny's shape, with a vocabulary hybrid pads (300 -> 320 at vocab_pad_multiple 64)."""
HYBRID_SHAPE = ["model=tiny", "data=synthetic", "model.vocab=300"]


def make_hf_dir(path: Path, *, tied: bool = True, seed: int = 0, tokenizer: bool = True) -> Path:
    """A random GPT-2 of ``SHAPE`` saved with ``save_pretrained``: every parameter drawn (no
    zero biases or unit norms that would hide a transposed tensor), no dropout, and a
    byte-level BPE of 300 ids trained on CPython's documentation as its tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(**SHAPE, tie_word_embeddings=tied, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    if tokenizer:
        save_byte_level_bpe(path, SHAPE["vocab_size"])
    return path


def save_byte_level_bpe(path: Path, vocab_size: int) -> None:
    """A byte-level BPE of ``vocab_size`` ids trained on CPython's documentation, saved as an
    HF directory's tokenizer (end of document: ``<|endoftext|>``, id 0)."""
    import pydoc_data.topics

    from hybrid.data.tokenizer import train_byte_level_bpe

    bpe = train_byte_level_bpe(list(pydoc_data.topics.topics.values()), vocab_size)
    bpe.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def load_hf(path: Path):
    from transformers import GPT2LMHeadModel

    model, info = GPT2LMHeadModel.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


def assert_exported_equals(original: Path, exported: Path, hf_class) -> None:
    """``exported`` (an HF folder hybrid-ckpt wrote) holds every tensor of ``original``'s
    safetensors, bitwise, and ``hf_class`` loads it with no key missing, unexpected or
    mismatched."""
    import torch
    from safetensors.torch import load_file

    before = load_file(original / "model.safetensors")
    after = load_file(exported / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    _, info = hf_class.from_pretrained(exported, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def hybrid_logits(rank, world, hf_dir, tokens):
    """A spawned rank: the logits of ``tokens`` from the HF folder ``hf_dir`` loaded as
    hybrid-generate loads it (one process)."""
    import torch

    from hybrid.generate import load_source, one_process_model

    with one_process_model(load_source(hf_dir)) as model, torch.no_grad():
        return model.logits(tokens)
