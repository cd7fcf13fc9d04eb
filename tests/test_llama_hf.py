"""HF ``LlamaForCausalLM`` in and out through ``hybrid-ckpt``: a tiny random one (grouped-query
attention, untied; and one tied), built and saved locally (nothing downloads), goes through
import then export with every tensor equal, and the imported model gives HF's logits within
1e-5 (fp32); configs hybrid cannot represent are one line, named."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_models import assert_exported_equals, hybrid_logits
from hybrid.testing import spawn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BIN = Path(sys.executable).parent
CKPT = str(BIN / "hybrid-ckpt")
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=32,
             rms_norm_eps=1e-5)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # real commands, HF models


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=200)


def make_llama_dir(path: Path, *, tied: bool, seed: int, tokenizer: bool = False) -> Path:
    """A random Llama saved with ``save_pretrained``: every parameter drawn (no unit norms
    that would hide a misplaced tensor); ``tokenizer``: with the byte-level BPE of
    ``hf_models`` (end of document: id 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPE, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    if tokenizer:
        from hf_models import save_byte_level_bpe

        save_byte_level_bpe(path, SHAPE["vocab_size"])
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hf-llama")
    return {"untied": make_llama_dir(folder / "untied", tied=False, seed=0),
            "tied": make_llama_dir(folder / "tied", tied=True, seed=1, tokenizer=True)}


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_import_then_export_changes_no_tensor(kind, hf_dirs, tmp_path):
    done = run(CKPT, "import", hf_dirs[kind], tmp_path / "imported")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "imported" / "step_00000000" / "hybrid.json").read_text())
    assert manifest["config"]["model"]["family"] == "llama"
    done = run(CKPT, "export", tmp_path / "imported", tmp_path / "out", "--format", "hf")
    assert done.returncode == 0, done.stderr
    from transformers import LlamaForCausalLM

    assert_exported_equals(hf_dirs[kind], tmp_path / "out", LlamaForCausalLM)


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_an_imported_llama_gives_hfs_logits(kind, hf_dirs):
    from transformers import LlamaForCausalLM

    tokens = torch.randint(0, 300, (3, 32), generator=torch.Generator().manual_seed(4))
    logits, = spawn(hybrid_logits, 1, str(hf_dirs[kind]), tokens, timeout=150)
    model = LlamaForCausalLM.from_pretrained(hf_dirs[kind]).eval()
    with torch.no_grad():
        hf_logits = model(tokens).logits
    assert logits.shape == hf_logits.shape
    assert (logits - hf_logits).abs().max() < 1e-5


@pytest.mark.parametrize("changes, needle", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope type 'yarn' (rope_scaling) is not supported; hybrid builds default, llama3"),
    ({"sliding_window": 16}, "sliding_window=16 cannot be converted: a sliding window is "
                             "Mistral's (model_type mistral)"),
    ({"attention_bias": True}, "attention_bias=True cannot be converted"),
])
def test_a_llama_hybrid_cannot_represent_is_one_line(changes, needle, tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    config = {"model_type": "llama", **SHAPE, **changes}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    done = run(CKPT, "import", folder, tmp_path / "out")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert needle in done.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("key, value, tensor", [
    ("intermediate_size", 48, "model.layers.0.mlp.gate_proj.weight"),
    ("num_key_value_heads", 4, "model.layers.0.self_attn.k_proj.weight")])
def test_a_config_that_disagrees_with_its_weights_is_one_line_at_import(key, value, tensor,
                                                                      hf_dirs, tmp_path):
    folder = tmp_path / "src"
    shutil.copytree(hf_dirs["untied"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    done = run(CKPT, "import", folder, tmp_path / "out")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"{tensor} has shape" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_llama_checkpoint_given_to_a_gpt2_config_is_one_line(hf_dirs, tmp_path):
    assert run(CKPT, "import", hf_dirs["untied"], tmp_path / "imported").returncode == 0
    done = run(BIN / "hybrid-train", "model=tiny", "data=synthetic", "model.vocab=300",
               "model.layers=3", "model.ffn_hidden=64", "parallel=single",
               f"checkpoint.init_from={tmp_path / 'imported'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    # The family leads; every other field that differs is named too (docs/checkpoints.md):
    # a GPT-2 has a key/value head per head, so the fix to paste sets both.
    assert done.stderr.startswith(
        "error: model.family, model.kv_heads: the checkpoint step_00000000 has family=llama, "
        "kv=2, the config family=gpt2, kv=4; set model.family=llama model.kv_heads=2 to match "
        "it"), done.stderr
    assert not (tmp_path / "run" / "workers").exists()


def test_greedy_generation_equals_hfs(hf_dirs):
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    prompt, source = "The assert statement", hf_dirs["tied"]
    done = run(BIN / "hybrid-generate", source, f"prompt={prompt}", "max_new_tokens=20",
               "temperature=0", "show_ids=true")
    assert done.returncode == 0, done.stderr
    ids = json.loads(re.search(r"new ids: (\[.*\])", done.stdout)[1])
    prompt_ids = Tokenizer.from_file(str(source / "tokenizer.json")).encode(prompt).ids
    input_ids = torch.tensor([prompt_ids])
    model = LlamaForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=20, do_sample=False, eos_token_id=0, pad_token_id=0)
    assert ids == out[0, len(prompt_ids):].tolist() and len(ids) > 1


def test_init_from_an_imported_llama_with_the_printed_overrides_trains(hf_dirs, tmp_path):
    done = run(CKPT, "import", hf_dirs["untied"], tmp_path / "imported")
    assert done.returncode == 0, done.stderr
    use = re.search(r"use: hybrid-train (.*)", done.stdout)[1].split()
    assert "model.family=llama" in use and "model.kv_heads=2" in use
    done = run(BIN / "hybrid-train", *use, "data=synthetic", "parallel=single",
               "parallel.tp=2", "train.steps=2", "train.global_batch=4", "train.micro_batch=2",
               "train.timeline_step=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "started from the weights of" in done.stdout
