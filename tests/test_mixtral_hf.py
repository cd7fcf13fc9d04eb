"""HF ``MixtralForCausalLM`` in and out through ``hybrid-ckpt`` (docs/moe.md): a tiny random one
(4 experts, top-2, grouped-query attention), built and saved locally (nothing downloads), in
the per-expert layout ``save_pretrained`` writes and in transformers' fused layout: import then
export gives every tensor back, the imported model's logits are HF's within 1e-5 (fp32), greedy
``hybrid-generate`` equals HF's greedy ``generate``; what hybrid cannot convert is one line."""

import json
import os
import re
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
SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
             rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2)

AUX_LOSS = 0.02
"""Not transformers' default (0.001): a coefficient dropped on import would show."""

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # real commands, HF models


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=200)


def make_mixtral(seed: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(**SHAPE, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                           router_aux_loss_coef=AUX_LOSS)
    model = MixtralForCausalLM(config)
    with torch.no_grad():  # every parameter drawn: no unit norm hides a misplaced tensor
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """The same model saved per expert (``save_pretrained``) and fused (its modules' own
    names, as transformers 5 holds them)."""
    from safetensors.torch import save_file

    from hf_models import save_byte_level_bpe

    folder = tmp_path_factory.mktemp("hf-mixtral")
    model = make_mixtral(seed=0)
    model.save_pretrained(folder / "per_expert")
    save_byte_level_bpe(folder / "per_expert", SHAPE["vocab_size"])
    fused = folder / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((folder / "per_expert" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(fused / "model.safetensors"))
    return {"per_expert": folder / "per_expert", "fused": fused}


def test_transformers_writes_the_per_expert_layout_and_holds_the_fused_one(hf_dirs):
    from safetensors.torch import load_file

    saved = load_file(hf_dirs["per_expert"] / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in saved
    fused = load_file(hf_dirs["fused"] / "model.safetensors")
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 96, 32)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_import_then_export_gives_every_tensor_back(layout, hf_dirs, tmp_path):
    done = run(CKPT, "import", hf_dirs[layout], tmp_path / "imported")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "imported" / "step_00000000" / "hybrid.json").read_text())
    assert manifest["config"]["model"]["moe"]["experts"] == 4
    assert "model.moe.experts=4" in done.stdout and "model.moe.topk=2" in done.stdout
    assert manifest["config"]["model"]["moe"]["aux_loss"] == AUX_LOSS
    assert f"model.moe.aux_loss={AUX_LOSS}" in done.stdout  # the use: line trains with it
    done = run(CKPT, "export", tmp_path / "imported", tmp_path / "out", "--format", "hf")
    assert done.returncode == 0, done.stderr
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["router_aux_loss_coef"] == AUX_LOSS
    from transformers import MixtralForCausalLM

    # either layout holds the same weights; export writes the per-expert one
    assert_exported_equals(hf_dirs["per_expert"], tmp_path / "out", MixtralForCausalLM)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_an_imported_mixtral_gives_hfs_logits(layout, hf_dirs):
    from transformers import MixtralForCausalLM

    tokens = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(4))
    logits, = spawn(hybrid_logits, 1, str(hf_dirs[layout]), tokens, timeout=150)
    model = MixtralForCausalLM.from_pretrained(hf_dirs["per_expert"]).eval()
    with torch.no_grad():
        hf_logits = model(tokens).logits
    assert logits.shape == hf_logits.shape
    assert (logits - hf_logits).abs().max() < 1e-5


def test_greedy_generation_equals_hfs(hf_dirs):
    from tokenizers import Tokenizer
    from transformers import MixtralForCausalLM

    prompt, source = "The assert statement", hf_dirs["per_expert"]
    done = run(BIN / "hybrid-generate", source, f"prompt={prompt}", "max_new_tokens=20",
               "temperature=0", "show_ids=true")
    assert done.returncode == 0, done.stderr
    ids = json.loads(re.search(r"new ids: (\[.*\])", done.stdout)[1])
    prompt_ids = Tokenizer.from_file(str(source / "tokenizer.json")).encode(prompt).ids
    input_ids = torch.tensor([prompt_ids])
    model = MixtralForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=20, do_sample=False, eos_token_id=0, pad_token_id=0)
    assert ids == out[0, len(prompt_ids):].tolist() and len(ids) > 1


@pytest.mark.parametrize("changes, needle", [
    ({"model_type": "deepseek_v3"},
     "holds a 'deepseek_v3' model; the registered model_types are gpt2, llama, mistral, "
     "mixtral, qwen2, qwen2_moe"),
    ({"model_type": "mixtral", "router_jitter_noise": 0.1},
     "router_jitter_noise=0.1 cannot be converted: hybrid's router adds no noise"),
    ({"model_type": "mixtral", "sliding_window": 16},
     "sliding_window=16 cannot be converted"),
    ({"model_type": "mixtral", "router_aux_loss_coef": -0.5},
     "router_aux_loss_coef=-0.5 must be a finite number >= 0"),
])
def test_an_moe_hybrid_cannot_convert_is_one_line(changes, needle, tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**SHAPE, **changes}))
    (folder / "model.safetensors").write_bytes(b"")
    done = run(CKPT, "import", folder, tmp_path / "out")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert needle in done.stderr and not (tmp_path / "out").exists()
