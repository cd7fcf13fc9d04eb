"""Sharded HF checkpoints in and out of ``hybrid-ckpt``, and context that is no shape.

Tiny random GPT-2 and Llama models saved as the hub ships big ones
(``save_pretrained(max_shard_size=...)``: shards and ``model.safetensors.index.json``) go
through import, then export with ``--max-shard-size``, and ``from_pretrained`` finds every
tensor equal; a damaged set is refused in one line before anything is written. A rotary model
loads at any ``model.seq_len``; a GPT-2 at fewer positions than its table, not more."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.checkpoint.store import CheckpointError, check_model_matches, model_shape
from hybrid.interop.shards import parse_size, shard_names, shard_plan
from hybrid.interop.hf_dir import ConversionError
from hybrid.planning.config import ModelConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BIN = Path(sys.executable).parent
CKPT = str(BIN / "hybrid-ckpt")
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
             rms_norm_eps=1e-5)


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=200)


# -- pure: sizes, the plan of shards, HF's names ---------------------------------------------

def test_sizes_read_as_hf_reads_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500kb") == 500_000 and parse_size("1234") == 1234
    for bad in ("", "5 parsecs", "-1GB", "0"):
        with pytest.raises(ConversionError, match="--max-shard-size"):
            parse_size(bad)


def test_shards_keep_order_and_bound_and_a_big_tensor_goes_alone():
    assert shard_plan({"a": 5, "b": 5, "c": 20, "d": 1}, 10) == [["a", "b"], ["c"], ["d"]]
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(2) == ["model-00001-of-00002.safetensors",
                              "model-00002-of-00002.safetensors"]


# -- pure: context against a checkpoint ------------------------------------------------------

def _manifest(model: ModelConfig) -> dict:
    return {"model": model_shape(model), "tensors": {}}


@pytest.mark.parametrize("padding", [True, False], ids=["resume", "init_from"])
@pytest.mark.parametrize("seq_len", [16, 64])
def test_a_rotary_model_loads_at_any_context(padding, seq_len):
    saved = ModelConfig(family="llama", layers=2, hidden=32, heads=4, seq_len=32, vocab=300)
    check_model_matches(_manifest(saved), ModelConfig(**{**saved.__dict__, "seq_len": seq_len}),
                        Path("step_00000000"), padding=padding)


def test_a_gpt2_starts_from_fewer_positions_but_not_more_or_on_resume():
    saved = ModelConfig(family="gpt2", layers=2, hidden=32, heads=4, seq_len=32, vocab=300)
    fewer = ModelConfig(**{**saved.__dict__, "seq_len": 16})
    more = ModelConfig(**{**saved.__dict__, "seq_len": 64})
    check_model_matches(_manifest(saved), fewer, Path("step_00000000"), padding=False)
    with pytest.raises(CheckpointError, match=r"model.seq_len=64: .* 32 tokens.*<= 32"):
        check_model_matches(_manifest(saved), more, Path("step_00000000"), padding=False)
    with pytest.raises(CheckpointError, match=r"set model.seq_len=32, or .*init_from"):
        check_model_matches(_manifest(saved), fewer, Path("step_00000000"), padding=True)


# -- real commands on sharded HF folders -----------------------------------------------------

def _random(model):
    import torch

    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


def make_sharded(path: Path, family: str) -> Path:
    """A random tied Llama (256 positions) or untied GPT-2 saved in shards of 20 kB."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=True,
                                             bos_token_id=0, eos_token_id=0))
    else:
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64,
                                           vocab_size=300, tie_word_embeddings=False))
    _random(model).save_pretrained(path, max_shard_size="20kB")
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2
    return path


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hf-sharded")
    return {family: make_sharded(folder / family, family) for family in ("llama", "gpt2")}


def _tensors_of(file: Path) -> list:
    from safetensors.torch import load_file

    return list(load_file(str(file)).values())


def _tensors(folder: Path) -> dict:
    from hybrid.interop.shards import iter_tensors

    return dict(iter_tensors(folder))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sharded_import_then_sharded_export_changes_no_tensor(family, sharded, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    done = run(CKPT, "import", sharded[family], tmp_path / "imported")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "exported"
    done = run(CKPT, "export", tmp_path / "imported", out, "--format", "hf",
               "--max-shard-size", "30kB")
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) >= 2 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}" \
        ".safetensors"
    for file in out.glob("*.safetensors"):  # at most 30 kB of data, or one tensor alone
        held = _tensors_of(file)
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held) <= 30_000
    before, after = _tensors(sharded[family]), _tensors(out)
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    original = AutoModelForCausalLM.from_pretrained(sharded[family])
    theirs, ours = original.state_dict(), loaded.state_dict()
    assert all(torch.equal(theirs[name], ours[name]) for name in theirs)
    if family == "llama":
        assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 256


def _damaged(source: Path, target: Path, how: str) -> Path:
    import shutil

    shutil.copytree(source, target)
    index = target / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())
    first = sorted(set(weight_map["weight_map"].values()))[0]
    if how == "missing":
        (target / first).unlink()
    elif how == "truncated":
        data = (target / first).read_bytes()
        (target / first).write_bytes(data[:len(data) - 100])
    elif how == "unheld":
        weight_map["weight_map"]["model.layers.9.mlp.up_proj.weight"] = first
        index.write_text(json.dumps(weight_map))
    else:
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, "model_type": "gemma9"}))
    return target


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how, needle", [
    ("missing", r"model-00001-of-\d+.safetensors, named by model.safetensors.index.json, is "
                r"missing"),
    ("truncated", r"model-00001-of-\d+.safetensors is truncated \(\d+ bytes, its header says"),
    ("unheld", r"puts model.layers.9.mlp.up_proj.weight in model-00001-of-\d+.safetensors, "
               r"which does not hold it"),
    ("unknown", r"'gemma9' model; the registered model_types are [a-z0-9, ]*gpt2, "
                r"[a-z0-9, ]*llama"),
])
def test_a_damaged_sharded_folder_is_one_line_and_writes_nothing(how, needle, sharded,
                                                                 tmp_path):
    import re

    folder = _damaged(sharded["llama"], tmp_path / "hf", how)
    done = run(CKPT, "import", folder, tmp_path / "out")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(needle, lines[0]), done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_imported_llama_trains_at_a_shorter_context_and_exports_its_own(sharded, tmp_path):
    done = run(CKPT, "import", sharded["llama"], tmp_path / "imported")
    assert done.returncode == 0, done.stderr
    use = done.stdout.split("use: hybrid-train ")[1].split()
    use = [u for u in use if not u.startswith("model.seq_len=")]
    done = run(BIN / "hybrid-train", *use, "model.seq_len=64", "data=synthetic",
               "parallel=single", "train.steps=2", "train.global_batch=2",
               "train.micro_batch=2", "train.timeline_step=0", "checkpoint.every=2",
               f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "started from the weights of" in done.stdout
    done = run(CKPT, "export", tmp_path / "run", tmp_path / "hf", "--format", "hf")
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["max_position_embeddings"] == 256


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_gpt2_starts_from_the_first_rows_of_its_positions_and_not_past_them(sharded,
                                                                              tmp_path):
    done = run(CKPT, "import", sharded["gpt2"], tmp_path / "imported")
    assert done.returncode == 0, done.stderr
    use = [u for u in done.stdout.split("use: hybrid-train ")[1].split()
           if not u.startswith("model.seq_len=")]
    common = [*use, "data=synthetic", "parallel=single", "train.steps=1",
              "train.global_batch=2", "train.micro_batch=2", "train.timeline_step=0"]
    done = run(BIN / "hybrid-train", *common, "model.seq_len=32",
               f"hydra.run.dir={tmp_path / 'short'}")
    assert done.returncode == 0, done.stderr[-3000:]
    done = run(BIN / "hybrid-train", *common, "model.seq_len=128",
               f"hydra.run.dir={tmp_path / 'long'}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "model.seq_len=128: the checkpoint step_00000000 has learned positions for 64" \
        in done.stderr.strip().splitlines()[-1]
