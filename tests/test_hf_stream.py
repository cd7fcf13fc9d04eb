"""Streamed ``hybrid-ckpt import`` and ``export --format hf`` (``hybrid.interop.hf_stream``).

The streamed import of each HF model equals the whole-model conversion (``hf_model``: every
tensor read, ``from_hf`` run once) tensor for tensor, names, dtypes and values; the streamed
export gives back every tensor of the source, in shards that ``from_pretrained`` loads, and
the loaded model's logits are the source model's. GPT-2 tied and untied, Llama 3.2 (tied),
Qwen2 (biases), Qwen3 (norms), Mistral, Mixtral in both expert layouts, a bf16 Llama, and a
tied Llama whose files carry a copy of the embedding as ``lm_head.weight``."""

import json
import os
from pathlib import Path

import pytest
import torch

from hf_models import make_hf_dir
from hf_variants import make_variant_dir
from hybrid.checkpoint.store import read_manifest
from hybrid.checkpoint.weights import read_model_weights
from hybrid.interop.convert import export_hf, hf_model, import_hf
from hybrid.interop.hf_dir import ConversionError
from hybrid.interop.shards import INDEX, iter_tensors

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # ten HF models built and converted


def _mixtral(folder: Path, fused: bool) -> Path:
    from safetensors.torch import save_file
    from test_mixtral_hf import make_mixtral

    model = make_mixtral(seed=1)
    if not fused:
        model.save_pretrained(folder, max_shard_size="40kB")
        return folder
    folder.mkdir()
    model.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    return folder


def _llama_copy_of_embedding(folder: Path, dtype=torch.float32) -> Path:
    """A tied Llama 3.2 whose files also hold ``lm_head.weight`` (older transformers saved
    the tied copy); ``dtype``: what it is saved as."""
    from safetensors.torch import load_file, save_file

    make_variant_dir(folder, "llama3.2", tokenizer=False)
    tensors = {k: v.to(dtype) for k, v in load_file(folder / "model.safetensors").items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _bf16(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM

    make_variant_dir(folder / "fp32", "qwen2", tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(folder / "fp32").to(torch.bfloat16)
    model.save_pretrained(folder / "bf16", max_shard_size="20kB")
    return folder / "bf16"


MAKERS = {
    "gpt2-tied": lambda f: make_hf_dir(f, tied=True, tokenizer=False),
    "gpt2-untied": lambda f: make_hf_dir(f, tied=False),
    "llama3.2": lambda f: make_variant_dir(f, "llama3.2"),
    "qwen2": lambda f: make_variant_dir(f, "qwen2", tokenizer=False),
    "qwen3": lambda f: make_variant_dir(f, "qwen3", tokenizer=False),
    "mistral": lambda f: make_variant_dir(f, "mistral", tokenizer=False),
    "mixtral-sharded": lambda f: _mixtral(f, fused=False),
    "mixtral-fused": lambda f: _mixtral(f, fused=True),
    "llama-lm-head-copy": _llama_copy_of_embedding,
    "qwen2-bf16-sharded": _bf16,
}


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (the HF folder, its streamed import's checkpoint)."""
    root = tmp_path_factory.mktemp("hf-stream")
    out = {}
    for name, make in MAKERS.items():
        folder = make(root / name)
        out[name] = folder, import_hf(str(folder), str(root / f"{name}-imported"))
    return out


@pytest.mark.parametrize("name", list(MAKERS))
def test_streamed_import_equals_the_whole_model_conversion(name, imported):
    folder, checkpoint = imported[name]
    _, whole, record, _ = hf_model(str(folder))
    streamed = read_model_weights(checkpoint)
    assert sorted(streamed) == sorted(whole)
    for key, tensor in whole.items():
        assert streamed[key].dtype == tensor.dtype, key
        assert torch.equal(streamed[key], tensor), key
    assert read_manifest(checkpoint)["tokenizer"] == record


def _logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    tokens = torch.arange(24).remainder(300).reshape(2, 12) * 7 % 300
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("name", list(MAKERS))
def test_streamed_export_gives_back_every_tensor_and_hfs_logits(name, imported, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, checkpoint = imported[name]
    out = tmp_path / "exported"
    export_hf(checkpoint, read_manifest(checkpoint), str(out), 30_000)
    source = dict(iter_tensors(folder))
    if json.loads((folder / "config.json").read_text()).get("tie_word_embeddings", True):
        source.pop("lm_head.weight", None)  # a tied model writes no copy
    exported = dict(iter_tensors(out))
    if name == "mixtral-fused":  # export writes the per-expert layout: compare through HF
        source = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[k], source[k]) and exported[k].dtype == source[k].dtype
               for k in source)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) >= 2 and (out / INDEX).is_file()
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert torch.equal(_logits(out), _logits(folder))


def test_a_tied_copy_that_differs_is_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _llama_copy_of_embedding(tmp_path / "llama")
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ConversionError, match="lm_head.weight differs from model.embed_tokens"):
        import_hf(str(folder), str(tmp_path / "out"))
