"""``model.from_hf``: each rank reads only its own slices of an HF folder's tensors.

For sharded GPT-2 and Llama, Qwen2 (biases), Qwen3 (head_dim, q/k norms) and Mixtral (experts),
every (tp, ep) rank of a pipeline stage loads its parameters through ``load_hf_weights`` with
a reader that counts what ``get_slice`` returns: the bytes read are exactly the rank's share
(its parameters' elements that HF holds, the vocabulary's padding rows aside), and every
parameter equals the slice of the whole-model conversion (``from_hf``, then narrowed). The
losses through ``hybrid-train`` on tp2 x pp2 and dp2 ZeRO-3 are in ``test_hf_from_dir.py``."""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybrid.interop.gpt2 import EMBEDDING, HEAD

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from hf_variants import make_variant_dir
    from test_hf_sharded import make_sharded
    from test_mixtral_hf import make_mixtral

    root = tmp_path_factory.mktemp("hf-slices")
    out = {family: make_sharded(root / family, family) for family in ("gpt2", "llama")}
    for name in ("qwen2", "qwen3"):
        out[name] = make_variant_dir(root / name, name, tokenizer=False)
    make_mixtral(seed=0).save_pretrained(root / "mixtral", max_shard_size="40kB")
    out["mixtral"] = root / "mixtral"
    return out


def _groups(tp: int, tp_rank: int, ep: int, ep_rank: int):
    layout = SimpleNamespace(tp=tp, ep=ep)
    return SimpleNamespace(layout=layout, tp_rank=tp_rank,
                           expert=SimpleNamespace(rank=lambda: ep_rank))


def _stage_params(model, groups, stage: int, stages: int) -> dict:
    """This pipeline stage's parameters (blocks split evenly), each of its TP/EP local shape."""
    from hybrid.planning.params import model_param_specs

    specs = list(model_param_specs(model).values())
    cut = len(specs) // stages
    out = {}
    for spec in specs[stage * cut:(stage + 1) * cut if stage < stages - 1 else None]:
        param = torch.nn.Parameter(torch.full(spec.local_shape(groups.layout.tp,
                                                              groups.layout.ep), float("nan")))
        param.spec = spec
        out[spec.name] = param
    return out


def _real_elements(model, name: str, param, groups) -> int:
    """The elements of this rank's slice that HF holds: all, but the vocabulary's padding."""
    spec = param.spec
    if name not in (EMBEDDING, HEAD):
        return param.numel()
    start = spec.local_offset(groups.tp_rank, groups.layout.tp)[0]
    rows = max(0, min(model.vocab, start + param.shape[0]) - start)
    return rows * param[0].numel()


def _whole_model_slices(folder: Path, model, params: dict, groups) -> dict:
    """The reference: the whole model converted by ``from_hf``, then each rank's slice."""
    from hybrid.checkpoint.weights import fit_positions
    from hybrid.interop.convert import name_map
    from hybrid.interop.gpt2 import pad_vocabulary
    from hybrid.interop.hf_dir import read_hf_weights
    from hybrid.interop.hf_source import source_model
    from hybrid.model.shards import load_global_weights
    from hybrid.planning.models import model_spec

    source = source_model(str(folder))
    weights = name_map(model_spec(source)).from_hf(read_hf_weights(str(folder)), source)
    weights = pad_vocabulary(fit_positions(weights, model.seq_len), model.padded_vocab)
    copies = {}
    for name, param in params.items():
        copies[name] = torch.nn.Parameter(torch.empty_like(param))
        copies[name].spec = param.spec
    load_global_weights(list(copies.values()), {n: weights[n] for n in copies}, groups)
    return copies


CASES = [("gpt2", 2, 1, 64), ("llama", 2, 1, 4), ("qwen2", 2, 1, 64), ("qwen3", 2, 1, 4),
         ("mixtral", 2, 2, 4)]


@pytest.mark.parametrize("family,tp,ep,pad", CASES, ids=[c[0] for c in CASES])
def test_each_rank_reads_its_share_and_nothing_else(folders, family, tp, ep, pad):
    _read_each_rank_checked(folders, family, tp, ep, pad)


def _read_each_rank_checked(folders, family, tp, ep, pad) -> list[int]:
    """Loads every (stage, tp, ep) rank's slices through a counting reader, checks each rank
    read exactly its share and got the whole-model values; the size of every block read."""
    from hybrid.interop.hf_source import load_hf_weights, source_model

    folder = folders[family]
    source = source_model(str(folder))
    model = dataclasses.replace(source, seq_len=32, vocab_pad_multiple=pad)
    read_by_rank = []
    for stage in range(2):
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                groups = _groups(tp, tp_rank, ep, ep_rank)
                params = _stage_params(model, groups, stage, 2)
                reads: list[tuple[str, int]] = []

                def counting(name, handle, block, reads=reads):
                    tensor = handle[block]
                    reads.append((name, tensor.numel() * tensor.element_size()))
                    return tensor

                load_hf_weights(str(folder), model, params, groups, reader=counting)
                share = sum(_real_elements(model, n, p, groups) for n, p in params.items())
                assert sum(size for _, size in reads) == 4 * share  # fp32 files
                expected = _whole_model_slices(folder, model, params, groups)
                for name, param in params.items():
                    assert torch.equal(param, expected[name]), name
                read_by_rank.append(reads)
    whole = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert max(sum(size for _, size in reads) for reads in read_by_rank) < whole / 2
    return [size for reads in read_by_rank for _, size in reads]


@pytest.mark.parametrize("family,tp,ep,pad", [CASES[0], CASES[4]], ids=["gpt2", "mixtral"])
def test_bands_of_a_few_elements_read_the_same(folders, family, tp, ep, pad, monkeypatch):
    """The loader works an index in bands of ``BAND`` elements, whole rows (its memory bound):
    at 5 elements every band is one row, no block read is more than a row of the widest
    tensor (128 fp32 elements; the tensors are up to 300 x 32), and the reads and values
    stay exact."""
    from hybrid.interop import hf_slices

    monkeypatch.setattr(hf_slices, "BAND", 5)
    blocks = _read_each_rank_checked(folders, family, tp, ep, pad)
    assert max(blocks) <= 4 * 128


def test_a_folder_the_map_does_not_name_is_read_whole(tmp_path, folders):
    """Mixtral's fused-experts files (transformers 5's module names) are not what the export
    map writes: the slice reader declines them untouched, and ``from_hf`` reads them whole
    (test_mixtral_hf holds that path equal to HF)."""
    from safetensors.torch import save_file

    from hybrid.interop.hf_slices import load_slices
    from hybrid.interop.convert import name_map
    from hybrid.interop.hf_source import source_model
    from hybrid.planning.models import model_spec
    from test_mixtral_hf import make_mixtral

    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((folders["mixtral"] / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in make_mixtral(seed=0).state_dict().items()},
              str(fused / "model.safetensors"))
    source = source_model(str(fused))
    groups = _groups(1, 0, 1, 0)
    params = _stage_params(source, groups, 0, 1)
    assert not load_slices(str(fused), source, source, name_map(model_spec(source)), params,
                           groups)
    assert all(bool(p.isnan().all()) for p in params.values())  # nothing half-copied
