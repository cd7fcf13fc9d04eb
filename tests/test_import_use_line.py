"""``hybrid-ckpt import``'s ``use:`` line carries every model field that differs from the base
config, the variants' included (Qwen2's q/k/v bias, Qwen3's head_dim and q/k norm, Llama 3.2's
llama3 rope scaling, norm epsilon, rope base): pasted into ``hybrid-train`` it composes the
model the checkpoint holds, and a run started from it trains HF's loss.

The line itself is checked without a process (HF's configs through the families' maps, then
Hydra's composition); one end-to-end run on the Llama 3.2 variant, whose rope scaling has no
weight, so a line without it would train a wrong loss with no word."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_variants import SHAPE, variant_configs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BIN = Path(sys.executable).parent


def imported_model(name: str):
    """The ``ModelConfig`` ``hybrid-ckpt import`` makes of variant ``name``'s config.json."""
    from hybrid.interop.convert import name_map
    from hybrid.planning.config import ModelConfig
    from hybrid.planning.models import family_for_hf

    _, config = variant_configs()[name]
    config = json.loads(config.to_json_string())  # as save_pretrained writes config.json
    spec = family_for_hf(config["model_type"])
    fields = name_map(spec).model_fields(config, name)
    return ModelConfig(**fields, family=spec.name, vocab_pad_multiple=1)


@pytest.mark.parametrize("name, carried", [
    ("qwen2", ["model.qkv_bias=true"]),
    ("qwen3", ["model.head_dim=16", "model.qk_norm=true"]),
    ("llama3.2", ["model.rope_scaling=llama3", "model.rope_factor=8.0",
                  "model.rope_original_positions=32", "model.tie_embeddings=true"]),
])
def test_the_use_line_composes_the_imported_model(name, carried):
    from launch.commands.app import compose_train_config
    from hybrid.interop.convert import RUN_FIELDS, shape_overrides

    model = imported_model(name)
    line = shape_overrides(model)
    assert set(carried) <= set(line), line
    composed = compose_train_config(line).model
    differ = {field: (getattr(composed, field), getattr(model, field))
              for field in model.__dataclass_fields__
              if field not in RUN_FIELDS and getattr(composed, field) != getattr(model, field)}
    assert not differ, differ


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_from_the_pasted_line_trains_hfs_loss(tmp_path):
    from hybrid.data import global_batch_indices, make_dataset
    from hybrid.metrics import read_metrics
    from hybrid.planning.config import from_dict

    source = _llama32(tmp_path / "hf")
    done = subprocess.run([str(BIN / "hybrid-ckpt"), "import", str(source),
                           str(tmp_path / "imported")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    use = done.stdout.split("use: hybrid-train ")[1].split()
    run_dir = tmp_path / "run"
    done = subprocess.run([str(BIN / "hybrid-train"), *use, "data=synthetic", "parallel=single",
                           "train.steps=1", "train.global_batch=4", "train.micro_batch=4",
                           "train.timeline_step=0", "seed=5", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    data = make_dataset(cfg.data, cfg.model, cfg.seed)
    indices = global_batch_indices(0, num_samples=len(data), global_batch=4, seed=cfg.seed)
    batch = torch.from_numpy(__import__("numpy").stack([data[int(i)] for i in indices]))
    loss = next(iter(read_metrics(run_dir / "metrics.jsonl")))["loss"]
    assert loss == pytest.approx(_hf_loss(source, batch), rel=1e-5)
    unscaled = _hf_loss(source, batch, {"rope_type": "default", "rope_theta": 10000.0})
    assert abs(unscaled - loss) > 1e-3 * loss  # a line without the scaling would show
    assert "note:" not in done.stderr  # no setting differs from the checkpoint's


def _llama32(path: Path) -> Path:
    """The Llama 3.2 variant with weights drawn at 0.5 (``hf_variants``' 0.2 leaves attention
    so flat that its rope scaling moves the loss by under 1e-4)."""
    hf_class, config = variant_configs()["llama3.2"]
    torch.manual_seed(0)
    model = hf_class(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def _hf_loss(source: Path, batch: torch.Tensor, rope: dict | None = None) -> float:
    """transformers' loss of ``batch`` on the model in ``source`` (``rope``: another
    ``rope_parameters``)."""
    hf_class, config = variant_configs()["llama3.2"]
    config = type(config).from_pretrained(source)
    if rope is not None:
        config.rope_parameters = rope
    model = hf_class.from_pretrained(source, config=config).eval()
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    vocab = SHAPE["vocab_size"]
    return F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1)).item()
