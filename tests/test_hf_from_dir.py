"""``model.from_hf=HF_DIR``: a sharded HF Llama (256 positions) trained at 64 with no
conversion step, its shape from config.json: the first step's loss is HF's on the same batch,
and dp2 x tp2 x pp2 and dp2 ZeRO-3 x pp2 give the 1-process losses; ``hybrid-plan`` plans it,
and a GPT-2 asked for more positions than it has is one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybrid.metrics import read_metrics
from test_hf_sharded import make_sharded

BIN = Path(sys.executable).parent
COMMON = ["data=synthetic", "model.seq_len=64", "train.global_batch=8", "train.micro_batch=2",
          "train.steps=3", "train.timeline_step=0", "train.log_every=100", "seed=21"]
LAYOUTS = {"single": ["parallel=single"],
           "dp2-tp2-pp2": ["parallel=dp2-tp2-pp2"],
           "dp2-zero3-pp2": ["parallel=single", "parallel.dp=2", "parallel.pp=2",
                             "parallel.zero=3"]}

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=500)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_sharded(tmp_path_factory.mktemp("hf") / "llama", "llama")


@pytest.fixture(scope="module")
def runs(llama, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, layout in LAYOUTS.items():
        out[name] = tmp_path_factory.mktemp(name)
        done = run(BIN / "hybrid-train", f"model.from_hf={llama}", *COMMON, *layout,
                   f"hydra.run.dir={out[name]}")
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"started from the weights of {llama}" in done.stdout
    return out


def _losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(run_dir / "metrics.jsonl")]


def test_the_first_step_is_hfs_loss_on_the_same_batch(llama, runs):
    from transformers import LlamaForCausalLM

    from hybrid.data import global_batch_indices, make_dataset
    from hybrid.planning.config import from_dict

    cfg = from_dict(json.loads((runs["single"] / "config.json").read_text()))
    assert (cfg.model.family, cfg.model.layers, cfg.model.kv_heads, cfg.model.seq_len) == \
        ("llama", 3, 2, 64)
    data = make_dataset(cfg.data, cfg.model, cfg.seed)
    indices = global_batch_indices(0, num_samples=len(data), global_batch=8, seed=cfg.seed)
    batch = torch.from_numpy(__import__("numpy").stack([data[int(i)] for i in indices]))
    model = LlamaForCausalLM.from_pretrained(llama).eval()
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    hf_loss = F.cross_entropy(logits.reshape(-1, 300), batch[:, 1:].reshape(-1)).item()
    assert _losses(runs["single"])[0] == pytest.approx(hf_loss, rel=1e-5)


@pytest.mark.parametrize("layout", ["dp2-tp2-pp2", "dp2-zero3-pp2"])
def test_every_layout_gives_the_one_process_losses(runs, layout):
    reference = _losses(runs["single"])
    assert len(reference) == 3
    assert _losses(runs[layout]) == pytest.approx(reference, rel=1e-4)


def test_hybrid_plan_plans_it(llama):
    done = run(BIN / "hybrid-plan", f"model.from_hf={llama}", "model.seq_len=64",
               "parallel=dp2-tp2-pp2", "format=json")
    assert done.returncode == 0, done.stderr[-2000:]
    model = json.loads(done.stdout)["model"]
    assert (model["name"], model["layers"], model["hidden"], model["vocab"],
            model["seq_len"]) == ("hf:llama", 3, 32, 300, 64)


def test_a_gpt2_past_its_positions_and_a_second_start_are_one_line(tmp_path):
    gpt2 = make_sharded(tmp_path / "gpt2", "gpt2")  # 64 positions
    for extra, needle in [(["model.seq_len=128"], "model.seq_len=128: "
                           f"{gpt2} has learned positions for 64 tokens; set model.seq_len <= 64"),
                          (["model.seq_len=32", f"checkpoint.init_from={tmp_path}"],
                           "both give the starting weights; drop one")]:
        done = run(BIN / "hybrid-train", f"model.from_hf={gpt2}", "data=synthetic",
                   "parallel=single", *extra, f"hydra.run.dir={tmp_path / 'run'}")
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert needle in done.stderr.strip().splitlines()[-1]
