"""HF GPT-2 with training, through the real commands: fine-tuning an imported HF model on
2x2x2 starts from HF's loss, and the model it trains, exported to HF, gives hybrid's 1-process
logits (one run for both); greedy hybrid-generate equals HF's greedy generate."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_models import HYBRID_SHAPE, load_hf, make_hf_dir
from hybrid.metrics import read_metrics
from hybrid.testing import spawn

BIN = Path(sys.executable).parent
COMMON = [*HYBRID_SHAPE, "model.tie_embeddings=true", "train.global_batch=8",
          "train.micro_batch=2", "train.timeline_step=0", "train.log_every=100", "seed=21"]

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def run(*args) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("hf")
    hf_dir = make_hf_dir(folder / "hf", tied=True, seed=5)
    run(BIN / "hybrid-ckpt", "import", hf_dir, folder / "imported")
    return {"hf": hf_dir, "checkpoint": folder / "imported"}


@pytest.fixture(scope="module")
def fine_tuned(imported, tmp_path_factory) -> tuple[Path, str]:
    """``imported`` fine-tuned for 4 steps on the base layout (DP 2 x TP 2 x PP 2, 1F1B),
    saving at step 4: its run directory and console output."""
    run_dir = tmp_path_factory.mktemp("fine-tuned")
    done = run(BIN / "hybrid-train", *COMMON, "train.steps=4", "checkpoint.every=4",
               f"checkpoint.init_from={imported['checkpoint']}", f"hydra.run.dir={run_dir}")
    return run_dir, done.stdout


def _logits(rank, world, weights_path, tokens):
    from hybrid.generate import Source, one_process_model
    from hybrid.planning.config import ModelConfig

    cfg = ModelConfig(layers=4, hidden=32, heads=4, vocab=300, seq_len=32, tie_embeddings=True)
    with one_process_model(Source(cfg, torch.load(weights_path), None, None, "t")) as model, \
            torch.no_grad():
        return model.logits(tokens)


def test_a_2x2x2_trained_model_exported_to_hf_gives_hybrids_logits(fine_tuned, tmp_path):
    run_dir, _ = fine_tuned
    run(BIN / "hybrid-ckpt", "export", run_dir, tmp_path / "hf", "--format", "hf")
    run(BIN / "hybrid-ckpt", "export", run_dir, tmp_path / "model.pt")
    tokens = torch.randint(0, 300, (3, 32), generator=torch.Generator().manual_seed(8))
    ours, = spawn(_logits, 1, str(tmp_path / "model.pt"), tokens, timeout=120)
    model, info = load_hf(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        theirs = model(tokens).logits
    assert theirs.shape == (3, 32, 300)  # the padding (300 -> 320) is gone
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_fine_tuning_an_imported_model_on_2x2x2_starts_from_hfs_loss(imported, fine_tuned):
    from hybrid.data import global_batch_indices, make_dataset
    from hybrid.planning.config import from_dict

    run_dir, stdout = fine_tuned
    first = read_metrics(run_dir / "metrics.jsonl")[0]
    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    data = make_dataset(cfg.data, cfg.model, cfg.seed)
    indices = global_batch_indices(0, num_samples=len(data), global_batch=8, seed=cfg.seed)
    batch = torch.from_numpy(__import__("numpy").stack([data[int(i)] for i in indices]))
    model, _ = load_hf(imported["hf"])
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    hf_loss = F.cross_entropy(logits.reshape(-1, 300), batch[:, 1:].reshape(-1)).item()
    assert first["step"] == 1 and first["loss"] == pytest.approx(hf_loss, rel=1e-5)
    assert "started from the weights of" in stdout


def test_greedy_generation_equals_hfs(imported):
    from tokenizers import Tokenizer

    prompt = "The assert statement"
    ids = {}
    for source in (imported["hf"], imported["checkpoint"]):
        done = run(BIN / "hybrid-generate", source, f"prompt={prompt}", "max_new_tokens=20",
                   "temperature=0", "show_ids=true")
        ids[source] = json.loads(re.search(r"new ids: (\[.*\])", done.stdout)[1])
    assert ids[imported["hf"]] == ids[imported["checkpoint"]]
    model, _ = load_hf(imported["hf"])
    prompt_ids = Tokenizer.from_file(str(imported["hf"] / "tokenizer.json")).encode(prompt).ids
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=20, do_sample=False, eos_token_id=0, pad_token_id=0)
    assert ids[imported["hf"]] == out[0, len(prompt_ids):].tolist()


def test_a_run_carries_its_datas_tokenizer_to_export_and_generation(imported, tmp_path):
    """Data tokenized with the HF model's own tokenizer, a fine-tuning run saving a
    checkpoint, then export and generation decode with that tokenizer."""
    import pydoc_data.topics

    text = tmp_path / "topics.txt"
    text.write_text("\n\n".join(pydoc_data.topics.topics.values()), encoding="utf-8")
    run(BIN / "hybrid-data", text, tmp_path / "topics", "--tokenizer", imported["hf"],
        "--format", "indexed", "--documents", "blank-lines", "--quiet")
    run(BIN / "hybrid-train", *[o for o in COMMON if o != "data=synthetic"], "data=indexed",
        f"data.path={tmp_path / 'topics'}", "parallel=single", "train.steps=2",
        "checkpoint.every=2", f"checkpoint.init_from={imported['checkpoint']}",
        f"hydra.run.dir={tmp_path / 'run'}")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert json.loads((checkpoint / "tokenizer.json").read_text()) == \
        json.loads((imported["hf"] / "tokenizer.json").read_text())
    done = run(BIN / "hybrid-ckpt", "export", tmp_path / "run", tmp_path / "hf", "--format", "hf")
    assert "with its tokenizer" in done.stdout
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.eos_token == "<|endoftext|>"
    done = run(BIN / "hybrid-generate", tmp_path / "run", "prompt=The for statement",
               "max_new_tokens=8", "temperature=0.5", "seed=3")
    assert done.stdout.startswith("The for statement")
