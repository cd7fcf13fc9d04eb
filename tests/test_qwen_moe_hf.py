"""HF ``Qwen2MoeForCausalLM`` in and out (docs/moe.md, "HF Qwen2-MoE and Qwen3-MoE"): a tiny
random one, its first layer dense (``mlp_only_layers=[0]``), 4 experts top-2 unrenormalised,
a shared expert with its sigmoid gate and q/k/v biases, saved sharded by ``save_pretrained``
(nothing downloads): import then export gives every tensor back, the imported model's logits
are HF's within 1e-5 (fp32), greedy ``hybrid-generate`` equals HF's greedy ``generate``, and
``model.from_hf`` trains with the aux loss on as the 1-process run does on dp2 x ep2 ZeRO-3,
dp2 x ep2 with dp_balance=dynamic, dp4 x ep4 ZeRO-2 and dp2 x ep2 x tp2 x pp2."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_models import hybrid_logits, save_byte_level_bpe
from hybrid.metrics import read_metrics
from hybrid.testing import spawn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BIN = Path(sys.executable).parent
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
             rms_norm_eps=1e-5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
             shared_expert_intermediate_size=40, mlp_only_layers=[0], norm_topk_prob=False,
             decoder_sparse_step=1)
AUX_LOSS = 0.02
"""Not transformers' default (0.001): a coefficient dropped on import would show."""

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]  # real commands, HF models


def run(*args, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout)


def make_qwen2_moe(path: Path, seed: int = 0) -> Path:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(**SHAPE, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                            router_aux_loss_coef=AUX_LOSS)
    model = Qwen2MoeForCausalLM(config)
    with torch.no_grad():  # every parameter drawn: no unit norm hides a misplaced tensor
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(path, max_shard_size="100kB")
    save_byte_level_bpe(path, SHAPE["vocab_size"])
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = make_qwen2_moe(tmp_path_factory.mktemp("hf") / "qwen2_moe")
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2
    return path


def all_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_import_then_export_gives_every_tensor_back(hf_dir, tmp_path):
    from transformers import Qwen2MoeForCausalLM

    done = run(BIN / "hybrid-ckpt", "import", hf_dir, tmp_path / "imported")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "imported" / "step_00000000" / "hybrid.json").read_text())
    model = manifest["config"]["model"]
    moe = model["moe"]
    assert (moe["experts"], moe["dense_layers"], moe["shared_ffn_hidden"],
            moe["norm_topk_prob"], model["qkv_bias"], moe["aux_loss"]) == \
        (4, [1], 40, False, True, AUX_LOSS)
    assert "model.moe.dense_layers=[1]" in done.stdout
    assert "model.moe.norm_topk_prob=false" in done.stdout
    done = run(BIN / "hybrid-ckpt", "export", tmp_path / "imported", tmp_path / "out",
               "--format", "hf")
    assert done.returncode == 0, done.stderr
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    original = json.loads((hf_dir / "config.json").read_text())
    for key in ("model_type", "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob",
                "shared_expert_intermediate_size", "router_aux_loss_coef", "qkv_bias"):
        assert exported[key] == original[key], key
    before, after = all_tensors(hf_dir), all_tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    _, info = Qwen2MoeForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def test_an_imported_qwen2_moe_gives_hfs_logits(hf_dir):
    from transformers import Qwen2MoeForCausalLM

    tokens = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(4))
    logits, = spawn(hybrid_logits, 1, str(hf_dir), tokens, timeout=150)
    model = Qwen2MoeForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        hf_logits = model(tokens).logits
    assert logits.shape == hf_logits.shape
    assert (logits - hf_logits).abs().max() < 1e-5


def test_greedy_generation_equals_hfs(hf_dir):
    from tokenizers import Tokenizer
    from transformers import Qwen2MoeForCausalLM

    prompt = "The assert statement"
    done = run(BIN / "hybrid-generate", hf_dir, f"prompt={prompt}", "max_new_tokens=20",
               "temperature=0", "show_ids=true")
    assert done.returncode == 0, done.stderr
    ids = json.loads(re.search(r"new ids: (\[.*\])", done.stdout)[1])
    prompt_ids = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(prompt).ids
    input_ids = torch.tensor([prompt_ids])
    model = Qwen2MoeForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=20, do_sample=False, eos_token_id=0, pad_token_id=0)
    assert ids == out[0, len(prompt_ids):].tolist() and len(ids) > 1


TRAIN = ["data=synthetic", "model.seq_len=32", "train.global_batch=8", "train.micro_batch=2",
         "train.steps=2", "train.timeline_step=0", "train.log_every=100", "seed=5",
         "parallel=single"]
LAYOUTS = {
    # issue 53's layouts on the model with a dense first layer and a shared expert, in two
    # runs: the four axes together on 8 ranks under ZeRO-3 (the experts' weights gathered
    # over their expert-DP group), and ep4 under ZeRO-2 with dynamic replica shares (which
    # ZeRO-3 takes only without a pipeline)
    "dp2-ep2-tp2-pp2-zero3": [
        "parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.pp=2",
        "parallel.schedule=1f1b", "parallel.zero=3", "parallel.bucket_mb=0.02"],
    "dp4-ep4-zero2-dynamic": ["parallel.dp=4", "parallel.ep=4", "parallel.zero=2",
                              "parallel.bucket_mb=0.02", "parallel.dp_balance=dynamic",
                              "parallel.dp_balance_every=1"],
}


def train_from_hf(hf_dir: Path, run_dir: Path, *layout: str) -> list[dict]:
    done = run(BIN / "hybrid-train", f"model.from_hf={hf_dir}", *TRAIN, *layout,
               f"hydra.run.dir={run_dir}", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def single_from_hf(hf_dir, tmp_path_factory) -> list[float]:
    run_dir = tmp_path_factory.mktemp("qwen2-moe-single")
    records = train_from_hf(hf_dir, run_dir)
    config = json.loads((run_dir / "config.json").read_text())["model"]
    assert config["moe"]["aux_loss"] == AUX_LOSS and config["moe"]["shared_ffn_hidden"] == 40
    assert len(records) == 2 and min(r["moe"]["aux_loss"] for r in records) > 0  # on, and in
    # the second step's weights; its figure is rank 0's micro-batches', compared on no layout
    return [r["loss"] for r in records]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_from_hf_trains_on_expert_layouts_as_the_1_process_run(name, hf_dir, single_from_hf,
                                                                  tmp_path):
    records = train_from_hf(hf_dir, tmp_path / name, *LAYOUTS[name])
    assert [r["loss"] for r in records] == pytest.approx(single_from_hf, rel=1e-4)


def test_a_qwen3_moe_with_a_sparse_step_round_trips_and_gives_hfs_logits(tmp_path):
    """Qwen3-MoE from the same specs: q/k norms, no shared expert, renormalised top-k, and
    ``decoder_sparse_step=2`` (layers 2 and 4 sparse), which export writes back."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1)
    shape = {k: v for k, v in SHAPE.items() if k != "shared_expert_intermediate_size"}
    config = Qwen3MoeConfig(**{**shape, "num_hidden_layers": 4, "mlp_only_layers": [],
                               "decoder_sparse_step": 2, "norm_topk_prob": True},
                            head_dim=16, tie_word_embeddings=False, router_aux_loss_coef=AUX_LOSS)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "hf")
    done = run(BIN / "hybrid-ckpt", "import", tmp_path / "hf", tmp_path / "imported")
    assert done.returncode == 0, done.stderr
    assert "model.moe.dense_layers=[1,3]" in done.stdout and "model.qk_norm=true" in done.stdout
    done = run(BIN / "hybrid-ckpt", "export", tmp_path / "imported", tmp_path / "out",
               "--format", "hf")
    assert done.returncode == 0, done.stderr
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["model_type"], exported["decoder_sparse_step"],
            exported["mlp_only_layers"]) == ("qwen3_moe", 2, [])
    before, after = all_tensors(tmp_path / "hf"), all_tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(4))
    logits, = spawn(hybrid_logits, 1, str(tmp_path / "hf"), tokens, timeout=150)
    with torch.no_grad():
        assert (logits - model.eval()(tokens).logits).abs().max() < 1e-5
