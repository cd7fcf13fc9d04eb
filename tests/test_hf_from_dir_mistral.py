"""``model.from_hf`` of a sharded Mistral whose sliding window (8) is shorter than the trained
sequence (64 of its 256 positions): through ``hybrid-train``, cp2 x tp2 gives the 1-process
losses, each rank reading its slices (``hybrid.interop.hf_slices``), and the first step's loss
is HF's on the same batch; its export writes the folder's 256 positions back."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybrid.metrics import read_metrics

BIN = Path(sys.executable).parent
COMMON = ["data=synthetic", "model.seq_len=64", "train.global_batch=4", "train.micro_batch=2",
          "train.steps=3", "train.timeline_step=0", "train.log_every=100", "seed=5"]
LAYOUTS = {"single": ["parallel=single", "checkpoint.every=3"],
           "cp2-tp2": ["parallel=single", "parallel.cp=2", "parallel.tp=2"]}

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    from hf_variants import SHAPE, WINDOW

    path = tmp_path_factory.mktemp("hf") / "mistral"
    torch.manual_seed(3)
    model = MistralForCausalLM(MistralConfig(**{**SHAPE, "max_position_embeddings": 256},
                                             sliding_window=WINDOW, tie_word_embeddings=False))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(path, max_shard_size="20kB")
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2
    return path


@pytest.fixture(scope="module")
def runs(mistral, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, layout in LAYOUTS.items():
        out[name] = tmp_path_factory.mktemp(name)
        done = subprocess.run([str(BIN / "hybrid-train"), f"model.from_hf={mistral}", *COMMON,
                               *layout, f"hydra.run.dir={out[name]}"], capture_output=True,
                              text=True, timeout=500)
        assert done.returncode == 0, done.stderr[-3000:]
    return out


def _losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(run_dir / "metrics.jsonl")]


def test_cp2_tp2_gives_the_one_process_losses(runs):
    reference = _losses(runs["single"])
    assert len(reference) == 3
    assert _losses(runs["cp2-tp2"]) == pytest.approx(reference, rel=1e-4)


def test_the_first_step_is_hfs_loss_past_the_window(mistral, runs):
    from transformers import MistralForCausalLM

    from hybrid.data import global_batch_indices, make_dataset
    from hybrid.planning.config import from_dict

    cfg = from_dict(json.loads((runs["single"] / "config.json").read_text()))
    assert cfg.model.sliding_window == 8 and cfg.model.seq_len == 64
    data = make_dataset(cfg.data, cfg.model, cfg.seed)
    indices = global_batch_indices(0, num_samples=len(data), global_batch=4, seed=cfg.seed)
    batch = torch.from_numpy(np.stack([data[int(i)] for i in indices]))
    model = MistralForCausalLM.from_pretrained(mistral, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    hf_loss = F.cross_entropy(logits.reshape(-1, 300), batch[:, 1:].reshape(-1)).item()
    assert _losses(runs["single"])[0] == pytest.approx(hf_loss, rel=1e-5)


def test_its_export_writes_the_folders_positions_back(runs, tmp_path):
    done = subprocess.run([str(BIN / "hybrid-ckpt"), "export", str(runs["single"]),
                           str(tmp_path / "hf"), "--format", "hf"], capture_output=True,
                          text=True, timeout=200)
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["max_position_embeddings"], config["sliding_window"]) == (256, 8)
