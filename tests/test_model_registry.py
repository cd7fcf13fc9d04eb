"""A model family registered from this file alone trains through ``hybrid-train`` on 2 ranks:
no core module knows it (docs/models.md, "adding a family").

``toy-mlp``: no attention and no positions; each layer is ``x + mlp(norm(x))`` on GPT-2's
LayerNorm and MLP, the embedding is the word table alone, the head is GPT-2's. Its pure side
(``ToyMlp``: parameter table, FLOPs, activation bytes, shape rules) and its torch side (the
three block constructors) are registered when this module is imported: by pytest here, and
on every rank by ``model.family_module=test_model_registry`` (this folder on PYTHONPATH).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from hybrid.model.blocks import MLP, HeadBlock, layer_norm, word_embedding
from hybrid.model.families import BLOCKS, FamilyBlocks, register_blocks
from hybrid.model.mappings import scatter_to_sequence_parallel_region
from hybrid.planning.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hybrid.planning.cost.flops import layer_forward_flops
from hybrid.planning.cost.sizes import param_count
from hybrid.planning.job import plan_job
from hybrid.planning.layout import LayoutError
from hybrid.planning.models import MODELS, model_spec, register_model
from hybrid.planning.models.gpt2 import Gpt2
from hybrid.planning.param_spec import column_specs, named, norm_specs, row_specs, vocab_matrix
from hybrid.planning.params import model_param_specs
from hybrid.testing.accounting import checked_records

HERE = Path(__file__).resolve().parent
TRAIN = str(Path(sys.executable).parent / "hybrid-train")
FAMILY = ["model=tiny", "model.family=toy-mlp", "model.family_module=test_model_registry"]
COMMON = [*FAMILY, "data=synthetic", "model.layers=2", "train.steps=4", "train.global_batch=8",
          "train.micro_batch=2", "train.log_every=100", "train.timeline_step=0", "seed=5",
          "parallel=single"]


class ToyMlp(Gpt2):
    """GPT-2's spec with the attention and the position table taken out."""

    name, doc = "toy-mlp", "a test's family: MLP layers only"
    blocks_module, hf_module, hf_model_type = __name__, None, None

    def block_params(self, m, block_id, sequence_parallel):
        h, sp = m.hidden, sequence_parallel
        if block_id == 0:
            return named("embedding.", {"word_embeddings.weight": vocab_matrix(
                m.padded_vocab, m.vocab, h, m.tie_embeddings)})
        if block_id == m.layers + 1:
            return super().block_params(m, block_id, sequence_parallel)
        local = {**norm_specs("norm", h, sp), **column_specs("mlp.fc1", m.ffn, h),
                 **row_specs("mlp.fc2", h, m.ffn, sp)}
        return named(f"blocks.{block_id}.", local)

    def layer_forward_flops(self, m, b):
        return 4 * b * m.seq_len * m.hidden * m.ffn

    def attention_core_flops(self, m, b):
        return 0.0

    def layer_activation_bytes(self, m, micro_batch, tp, sp, precision, recompute="none",
                               cp=1):
        s, b, h = m.seq_len // cp, micro_batch, m.hidden
        stream = 4 * s * b * h // (tp if sp else 1)
        return stream if recompute == "full" else 2 * stream + 2 * m.ffn * s * b // tp * 4


class ToyEmbedding(nn.Module):
    def __init__(self, cfg, tp_group, *, generator, sequence_parallel, context):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.word_embeddings = word_embedding(cfg, tp_group, generator)

    def forward(self, tokens):
        hidden = self.word_embeddings(tokens.t())
        if self.sequence_parallel:
            hidden = scatter_to_sequence_parallel_region(hidden, self.tp_group)
        return hidden


class ToyLayer(nn.Module):
    def __init__(self, cfg, tp_group, *, generator, sequence_parallel, context):
        super().__init__()
        self.norm = layer_norm(cfg)
        self.mlp = MLP(cfg, tp_group, generator=generator, sequence_parallel=sequence_parallel)

    def forward(self, hidden):
        return hidden + self.mlp(self.norm(hidden))


register_model(ToyMlp())
register_blocks("toy-mlp", FamilyBlocks(embedding=ToyEmbedding, layer=ToyLayer,
                                        head=HeadBlock))


def _run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([TRAIN, *COMMON, f"hydra.run.dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=240, env=env)


def _toy(**model) -> ModelConfig:
    return ModelConfig(family="toy-mlp", layers=2, **model)


def test_the_registry_answers_for_a_family_it_was_told_of():
    m = _toy()
    assert model_spec(m) is MODELS["toy-mlp"]
    names = list(model_param_specs(m))
    assert names[0] == "embedding.word_embeddings.weight" and "blocks.1.norm.weight" in names
    assert not any("attention" in n or "position" in n for n in names)
    h, f, v = m.hidden, m.ffn, m.padded_vocab
    assert param_count(m) == v * h + 2 * (2 * h + f * h + f + h * f + h) + 2 * h + v * h
    assert layer_forward_flops(m, 1) == 4 * m.seq_len * h * f
    plan = plan_job(Config(model=m, parallel=ParallelConfig(tp=2, pp=2),
                           train=TrainConfig(global_batch=8, micro_batch=2)))
    assert plan.layout.world_size == 4


def test_an_unknown_family_or_module_is_one_line():
    with pytest.raises(LayoutError, match=r"model.family='nope' is unknown; choose one of "
                                          r"gpt2.*set model.family_module"):
        model_spec(ModelConfig(family="nope"))
    with pytest.raises(LayoutError, match=r"model.family_module='no_such_mod' cannot be "
                                          r"imported .*PYTHONPATH"):
        model_spec(ModelConfig(family="nope", family_module="no_such_mod"))


def test_gpt2_is_the_default_family():
    assert ModelConfig().family == "gpt2" and model_spec(ModelConfig()).name == "gpt2"
    assert BLOCKS["toy-mlp"].head is HeadBlock


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_test_defined_family_trains_on_2_ranks_as_on_1(tmp_path):
    done = _run(tmp_path / "one")
    assert done.returncode == 0, done.stderr[-3000:]
    reference = [r["loss"] for r in checked_records(tmp_path / "one")]
    done = _run(tmp_path / "tp2", "parallel.tp=2", "parallel.sequence_parallel=true")
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [r["loss"] for r in checked_records(tmp_path / "tp2")]
    assert len(losses) == len(reference) == 4
    assert losses[0] == pytest.approx(reference[0], rel=1e-5)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert reference[-1] < reference[0]  # it learns


@pytest.mark.parametrize("overrides, needle", [
    (["model.family=nope", "model.family_module=null"], "model.family='nope' is unknown"),
    (["model.family_module=no_such_module"], "model.family_module='no_such_module' cannot"),
])
def test_hybrid_train_refuses_an_unknown_family_in_one_line(overrides, needle, tmp_path):
    done = _run(tmp_path, *overrides)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert "Traceback" not in done.stderr and not (tmp_path / "config.json").exists()

