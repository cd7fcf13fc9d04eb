"""HF GPT-2 in and out through ``hybrid-ckpt``: a round trip changes no tensor (and writes a
folder with the usual modes), an imported model in hybrid's 1-process GPT gives HF's logits and
loss, and bad sources and outputs are one line."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_models import HYBRID_SHAPE, SHAPE, load_hf, make_hf_dir
from hybrid.testing import spawn

BIN = Path(sys.executable).parent
CKPT, TRAIN = str(BIN / "hybrid-ckpt"), str(BIN / "hybrid-train")

pytestmark = pytest.mark.timeout(180)


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=150)


@pytest.fixture(scope="module")
def hf_dirs(hf_gpt2, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hf")
    return {"tied": hf_gpt2,
            "untied": make_hf_dir(folder / "untied", tied=False, seed=1, tokenizer=False)}


@pytest.fixture(scope="module")
def imported(hf_imported) -> Path:
    return hf_imported


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_import_then_export_changes_no_tensor(kind, hf_dirs, tmp_path):
    from safetensors.torch import load_file

    source = hf_dirs[kind]
    done = run(CKPT, "import", source, tmp_path / "imported")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "imported" / "step_00000000" / "hybrid.json").is_file()
    done = run(CKPT, "export", tmp_path / "imported", tmp_path / "out", "--format", "hf")
    assert done.returncode == 0, done.stderr
    before, after = load_file(source / "model.safetensors"), load_file(
        tmp_path / "out" / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode)
             for path in [tmp_path / "out", *(tmp_path / "out").iterdir()]}
    assert modes.pop("out") == 0o777 & ~umask  # as mkdir makes it (mkdtemp's 0700 stayed)
    assert set(modes.values()) == {0o666 & ~umask}, modes
    model, info = load_hf(tmp_path / "out")
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: config[k] for k in SHAPE} == SHAPE
    assert config["tie_word_embeddings"] == (kind == "tied")
    assert model.lm_head.weight is model.transformer.wte.weight or kind == "untied"
    if kind == "tied":  # the tokenizer goes along, and loads in transformers as it was
        from transformers import AutoTokenizer

        assert (tmp_path / "out" / "tokenizer.json").read_text() == \
            (source / "tokenizer.json").read_text()
        text = "The assert statement checks a condition."
        hf_ids = AutoTokenizer.from_pretrained(tmp_path / "out")(text)["input_ids"]
        from tokenizers import Tokenizer

        assert hf_ids == Tokenizer.from_file(str(source / "tokenizer.json")).encode(text).ids


def _hybrid_logits(rank, world, weights_path, tied, tokens):
    from hybrid.generate import Source, one_process_model
    from hybrid.planning.config import ModelConfig

    model_cfg = ModelConfig(layers=4, hidden=32, heads=4, vocab=300, seq_len=32,
                            tie_embeddings=tied)  # pads to 320: the import holds 300 rows
    weights = torch.load(weights_path)
    with one_process_model(Source(model_cfg, weights, None, None, "test")) as model, \
            torch.no_grad():
        logits = model.logits(tokens)
        loss = model(tokens[:, :-1], tokens[:, 1:]).item()
    return logits, loss


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_an_imported_model_gives_hfs_logits_and_loss(kind, hf_dirs, tmp_path):
    from hybrid.checkpoint.weights import read_model_weights

    assert run(CKPT, "import", hf_dirs[kind], tmp_path / "imported").returncode == 0
    weights = read_model_weights(tmp_path / "imported" / "step_00000000")
    assert weights["embedding.word_embeddings.weight"].shape[0] == 300  # no padding stored
    torch.save(weights, tmp_path / "weights.pt")
    tokens = torch.randint(0, 300, (3, 32), generator=torch.Generator().manual_seed(4))
    (logits, loss), = spawn(_hybrid_logits, 1, str(tmp_path / "weights.pt"), kind == "tied",
                            tokens, timeout=120)
    model, _ = load_hf(hf_dirs[kind])
    with torch.no_grad():
        hf_logits = model(tokens).logits
        hf_loss = F.cross_entropy(model(tokens[:, :-1]).logits.reshape(-1, 300),
                                  tokens[:, 1:].reshape(-1)).item()
    assert (logits - hf_logits).abs().max() < 1e-5
    assert loss == pytest.approx(hf_loss, rel=1e-5)  # padding is masked: HF's loss exactly


def _hf_dir(folder: Path, **changes) -> Path:
    """A directory that looks like an HF GPT-2 one until its config is read (weights are never
    reached: the config is refused first)."""
    folder.mkdir()
    config = {"model_type": "gpt2", "activation_function": "gelu_new", "n_embd": 32,
              "n_head": 4, "n_layer": 4, "n_positions": 32, "vocab_size": 300, **changes}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize("name, make, needle", [
    ("missing", lambda d: d / "nothing", "is not a folder; pass a local HF model directory"),
    ("no config", lambda d: (d / "empty").mkdir() or d / "empty",
     "has no config.json: it is not an HF model directory"),
    ("bloom", lambda d: _hf_dir(d / "bloom", model_type="bloom"),
     "holds a 'bloom' model; the registered model_types are "),
    ("erf gelu", lambda d: _hf_dir(d / "gelu", activation_function="gelu"),
     "activation_function='gelu' cannot be converted: hybrid's GELU is the tanh one"),
    ("cross attention", lambda d: _hf_dir(d / "cross", add_cross_attention=True),
     "add_cross_attention=True cannot be converted: hybrid is decoder-only"),
])
def test_a_source_that_is_not_a_gpt2_is_one_line(name, make, needle, tmp_path):
    done = run(CKPT, "import", make(tmp_path), tmp_path / "out")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert needle in done.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("overrides, needle", [
    (["model.hidden=64", "model.heads=4"],
     "model.hidden, model.ffn_hidden: the checkpoint step_00000000 has hidden=32, ffn=128, "
     "the config hidden=64, ffn=256"),
    (["checkpoint.resume_from=auto"], "checkpoint.init_from and checkpoint.resume_from are both"),
])
def test_init_from_is_checked_before_launch(overrides, needle, imported, tmp_path):
    done = run(TRAIN, *HYBRID_SHAPE, "model.tie_embeddings=true", "parallel=single",
               f"checkpoint.init_from={imported}", *overrides,
               f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert needle in done.stderr
    assert not (tmp_path / "run" / "workers").exists()


def _changed(source: Path, folder: Path, change) -> Path:
    """A copy of the HF directory ``source`` with ``change(copy)`` applied."""
    copy = shutil.copytree(source, folder)
    change(copy)
    return copy


def _config(**changes):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return change


def _empty_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models

    empty = Tokenizer(models.BPE(vocab={}, merges=[]))
    empty.add_special_tokens(["<|endoftext|>"])
    empty.save(str(folder / "tokenizer.json"))


@pytest.mark.slow
@pytest.mark.parametrize("change, needle", [
    (_config(n_embd=64), "transformer.wte.weight has shape [300, 32], config.json implies "
                         "[300, 64]"),
    (_config(n_inner=64), "transformer.h.0.mlp.c_fc.weight has shape [32, 128], config.json "
                          "implies [32, 64]"),
    (_config(n_positions=64), "transformer.wpe.weight has shape [32, 32], config.json implies "
                              "[64, 32]"),
    (_empty_tokenizer, "tokenizer.json has an empty vocabulary (special tokens only: 1), so "
                       "no text encodes to any token"),
    (lambda d: (d / "tokenizer.json").write_text("{not json"),
     "tokenizer.json is not an HF tokenizer"),
    (lambda d: (d / "tokenizer_config.json").write_text("{not json"),
     "tokenizer_config.json is not a JSON object"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:99]),
     "model.safetensors cannot be read"),
], ids=["n_embd", "n_inner", "n_positions", "empty vocabulary", "bad tokenizer",
        "bad tokenizer config", "truncated weights"])
def test_a_source_that_disagrees_with_itself_is_one_line_at_import(change, needle, hf_gpt2,
                                                                   tmp_path):
    source = _changed(hf_gpt2, tmp_path / "hf", change)
    done = run(CKPT, "import", source, tmp_path / "out")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(done.stderr.strip().splitlines()) == 1 and needle in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux's /sys")
@pytest.mark.parametrize("form", ["torch", "hf"])
def test_an_export_that_cannot_be_written_is_one_line(form, imported):
    """sysfs refuses to create a file or a folder even for root (tests run as root, whom a
    chmod does not stop)."""
    out = "/sys/kernel/hybrid-export"
    done = run(CKPT, "export", imported, out, "--format", form)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"cannot write {out}: " in done.stderr and \
        "choose an output path on a writable file system" in done.stderr
    assert not os.path.exists(out) and done.stdout == ""
