"""One identity per parameter: the spec table (pure) and the specs the built model carries."""

import pytest
import torch

from hybrid.planning.config import ModelConfig
from hybrid.planning.cost.sizes import param_count
from hybrid.planning.params import EMBEDDING_WEIGHT, block_param_specs, model_param_specs
from hybrid.testing import spawn

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("tied", [False, True])
def test_spec_table_counts_every_parameter_once(tied):
    cfg = ModelConfig(layers=3, hidden=16, heads=4, vocab=100, tie_embeddings=tied)
    specs = model_param_specs(cfg)
    assert sum(spec.numel for spec in specs.values()) == param_count(cfg)
    assert ("head.output_layer.weight" in specs) is not tied
    assert specs[EMBEDDING_WEIGHT].shape == (128, 16) and specs[EMBEDDING_WEIGHT].real_rows == 100
    assert specs[EMBEDDING_WEIGHT].tied is tied
    assert all(name == spec.name for name, spec in specs.items())


def test_names_do_not_depend_on_the_layout_and_shards_tile_the_global_shape():
    cfg = ModelConfig(layers=2, hidden=16, heads=4, ffn_hidden=24)
    qkv = block_param_specs(cfg, 2)["attention.qkv.weight"]
    proj = block_param_specs(cfg, 2)["attention.proj.weight"]
    assert qkv.name == "blocks.2.attention.qkv.weight" and qkv.tp_dim == 0
    assert proj.tp_dim == 1 and proj.local_shape(4) == (16, 4)
    assert [proj.local_offset(r, 4) for r in range(4)] == [(0, 0), (0, 4), (0, 8), (0, 12)]
    sp = block_param_specs(cfg, 1, sequence_parallel=True)
    assert sorted(k for k, s in sp.items() if s.sequence_partial) == [
        "attention.proj.bias", "input_norm.bias", "input_norm.weight", "mlp.fc2.bias",
        "mlp_norm.bias", "mlp_norm.weight"]
    with pytest.raises(ValueError, match="outside"):
        block_param_specs(cfg, 4)


def _built_specs_match_the_reference_by_name(rank, world):
    from hybrid.groups import ParallelGroups
    from hybrid.planning.layout import Layout
    from hybrid.model import GPT, gather_tp_param

    cfg = ModelConfig(layers=2, hidden=16, heads=4, vocab=100, tie_embeddings=True)
    model = GPT(cfg, ParallelGroups.create(Layout(tp=2)), seed=3, sequence_parallel=True)
    reference = GPT(cfg, ParallelGroups.create(Layout()), seed=3)
    by_name = {p.spec.name: p for p in reference.parameters()}
    mismatched = [p.spec.name for p in model.parameters()
                  if not torch.equal(gather_tp_param(p.detach(), p, model.groups),
                                     by_name[p.spec.name])]
    return sorted(by_name), sorted({p.spec.name for p in model.parameters()}), mismatched


def test_every_built_parameter_carries_its_spec_and_its_shard_is_a_slice_of_it():
    for names, built, mismatched in spawn(_built_specs_match_the_reference_by_name, 2):
        assert built == names == sorted(model_param_specs(
            ModelConfig(layers=2, hidden=16, heads=4, vocab=100, tie_embeddings=True)))
        assert mismatched == []
