"""The llama family's HF variants through ``hybrid-ckpt`` and ``hybrid-generate``: a tiny random
Llama 3.2 (rope_scaling llama3, tied), Qwen2 (q/k/v biases), Qwen3 (head_dim 16 over hidden 32 /
4 heads, q/k norms) and Mistral (sliding window 8 under 32 tokens), built and saved locally
(``hf_variants``). For each: import then export leaves every tensor equal and
``from_pretrained`` loads it; a batch's logits are HF's within 1e-5 (fp32); greedy generation is
HF's, past the window for Mistral. A rope type hybrid does not build is one line."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_models import assert_exported_equals, hybrid_logits
from hf_variants import SHAPE, WINDOW, make_variant_dir, variant_configs
from hybrid.testing import spawn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BIN = Path(sys.executable).parent
CKPT = str(BIN / "hybrid-ckpt")
VARIANTS = ("llama3.2", "qwen2", "qwen3", "mistral")

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # real commands, HF models


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=200)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hf-variants")
    return {name: make_variant_dir(folder / name, name, seed=i)
            for i, name in enumerate(VARIANTS)}


@pytest.mark.parametrize("name", VARIANTS)
def test_import_then_export_changes_no_tensor(name, hf_dirs, tmp_path):
    done = run(CKPT, "import", hf_dirs[name], tmp_path / "imported")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "imported" / "step_00000000" / "hybrid.json").read_text())
    model = manifest["config"]["model"]
    assert model["family"] == "llama"
    expected = {"llama3.2": {"rope_scaling": "llama3", "rope_factor": 8.0},
                "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True, "head_dim": 16},
                "mistral": {"sliding_window": WINDOW}}[name]
    assert {key: model[key] for key in expected} == expected
    done = run(CKPT, "export", tmp_path / "imported", tmp_path / "out", "--format", "hf")
    assert done.returncode == 0, done.stderr
    hf_class, _ = variant_configs()[name]
    assert_exported_equals(hf_dirs[name], tmp_path / "out", hf_class)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [hf_class.__name__]


@pytest.mark.parametrize("name", VARIANTS)
def test_an_imported_variant_gives_hfs_logits(name, hf_dirs):
    tokens = torch.randint(0, SHAPE["vocab_size"], (3, 32),
                           generator=torch.Generator().manual_seed(4))
    logits, = spawn(hybrid_logits, 1, str(hf_dirs[name]), tokens, timeout=150)
    hf_class, _ = variant_configs()[name]
    model = hf_class.from_pretrained(hf_dirs[name]).eval()
    with torch.no_grad():
        hf_logits = model(tokens).logits
    assert logits.shape == hf_logits.shape
    assert (logits - hf_logits).abs().max() < 1e-5


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_generation_equals_hfs(name, hf_dirs):
    """20 new tokens after the prompt: past Mistral's window of 8, so the KV cache's window
    (the prompt's masked attention, then each token's last 8 keys) is what is compared."""
    from tokenizers import Tokenizer

    prompt, source = "The assert statement", hf_dirs[name]
    done = run(BIN / "hybrid-generate", source, f"prompt={prompt}", "max_new_tokens=20",
               "temperature=0", "show_ids=true")
    assert done.returncode == 0, done.stderr
    ids = json.loads(re.search(r"new ids: (\[.*\])", done.stdout)[1])
    prompt_ids = Tokenizer.from_file(str(source / "tokenizer.json")).encode(prompt).ids
    assert len(prompt_ids) + len(ids) > WINDOW
    input_ids = torch.tensor([prompt_ids])
    hf_class, _ = variant_configs()[name]
    model = hf_class.from_pretrained(source).eval()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=20, do_sample=False, eos_token_id=0, pad_token_id=0)
    assert ids == out[0, len(prompt_ids):].tolist() and len(ids) > 1


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0},
                                  {"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope"}])
def test_an_unsupported_rope_type_is_one_line_at_import(model_type, rope, tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    config = {"model_type": model_type, **SHAPE, "rope_scaling": rope}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    done = run(CKPT, "import", folder, tmp_path / "out")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert (f"rope type {rope['rope_type']!r} (rope_scaling) is not supported; hybrid builds "
            f"default, llama3") in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type, changes, needle", [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8},
     "use_sliding_window=True cannot be converted"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True cannot be converted"),
    ("llama", {"sliding_window": 16}, "sliding_window=16 cannot be converted: a sliding "
                                      "window is Mistral's"),
])
def test_a_variant_setting_hybrid_cannot_represent_is_one_line(model_type, changes, needle,
                                                               tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **SHAPE,
                                                    **changes}))
    (folder / "model.safetensors").write_bytes(b"")
    done = run(CKPT, "import", folder, tmp_path / "out")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert needle in done.stderr
