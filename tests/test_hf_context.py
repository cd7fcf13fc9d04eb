"""``hybrid-generate context=N`` and ``model.from_hf``'s tokenizer (docs/models.md).

A rotary model generates over any context, by default the positions of the model it was made
from (an HF folder's ``max_position_embeddings``; for a run's checkpoint, those of the folder
or checkpoint the run started from, not the ``seq_len`` it was fine-tuned at); GPT-2's learned
positions are sliced to a shorter context and refused beyond their table in one line. Data
tokenized with another tokenizer than the folder's is refused before launch in one line."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_models import make_hf_dir
from hf_variants import make_variant_dir
from hybrid.generate import GenerateError, load_source

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BIN = Path(sys.executable).parent


def test_gpt2_generates_at_fewer_positions_and_refuses_more(tmp_path):
    folder = make_hf_dir(tmp_path / "gpt2", tokenizer=False)  # 32 positions
    shorter = load_source(str(folder), context=16)
    assert shorter.model.seq_len == 16
    assert shorter.weights["embedding.position_embeddings"].shape[0] == 16
    assert load_source(str(folder)).model.seq_len == 32
    with pytest.raises(GenerateError) as refused:
        load_source(str(folder), context=64)
    assert str(refused.value) == (f"context=64: {folder} has learned positions for 32 tokens; "
                                  f"choose context <= 32")


def test_a_rotary_checkpoint_generates_at_its_sources_context_or_any(tmp_path):
    """A checkpoint trained at 16 positions from an HF folder of 64: 64 by default, any
    other when asked."""
    from hybrid.checkpoint.store import model_shape
    from hybrid.checkpoint.weights import write_weights_checkpoint
    from hybrid.interop.convert import hf_model

    folder = make_variant_dir(tmp_path / "llama", "llama3.2", tokenizer=False)
    model, weights, _, _ = hf_model(str(folder))
    assert model.seq_len == 64
    fields = {**dataclasses.asdict(model), "seq_len": 16, "from_hf": str(folder)}
    checkpoint = write_weights_checkpoint(tmp_path / "run", weights, model_shape=model_shape(
        model), config={"model": fields}, source=str(folder))
    assert load_source(str(checkpoint)).model.seq_len == 64
    assert load_source(str(checkpoint), context=200).model.seq_len == 200
    assert load_source(str(folder), context=8).model.seq_len == 8


def test_context_must_be_positive():
    from launch.commands.generate import parse

    assert parse(["src", "prompt=a", "context=512"]).context == 512
    with pytest.raises(GenerateError, match="context=0 must be >= 1"):
        parse(["src", "prompt=a", "context=0"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_of_another_tokenizer_is_refused_before_launch(tmp_path):
    """Byte-level data (hybrid-data's default) for a model whose folder has a BPE."""
    from hybrid.data.prepare import Request, prepare_data

    folder = make_hf_dir(tmp_path / "gpt2")  # with its byte-level BPE tokenizer.json
    text = tmp_path / "text.txt"
    text.write_text("hello world, " * 2000)
    prepare_data(Request(inputs=[str(text)], output=str(tmp_path / "bytes.bin"),
                         progress=False))
    done = subprocess.run([str(BIN / "hybrid-train"), f"model.from_hf={folder}",
                           "data=tokens", f"data.path={tmp_path / 'bytes.bin'}",
                           "model.seq_len=32", "parallel=single",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=250)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'bytes.bin'} was tokenized with bytes, not the tokenizer of "
        f"model.from_hf={folder}; tokenize it with hybrid-data --tokenizer {folder}")
