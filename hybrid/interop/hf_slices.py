"""Each rank reads only its own slices of an HF folder's safetensors (``model.from_hf``).

Which bytes of which HF tensor a parameter's TP/EP slice comes from is found by running the
family's own export map (``to_hf``) on an *index* tensor: the parameter holding its element
numbers, every other parameter a ``meta`` tensor (no storage). Wherever an HF tensor carries
element numbers, those elements came from this parameter, however the map renames, transposes,
splits or re-orders them (GPT-2's Conv1D and head-major QKV, Llama's grouped q/k/v, Mixtral's
stacked experts). The rows and columns of each HF tensor that hold this rank's elements are
read with ``safe_open(...).get_slice(...)`` in contiguous blocks of at most ``BAND`` elements
(or one row), straight into the parameter, so a rank reads exactly its share. Beyond its
parameters it holds one tensor's index at a time (int32 for a tensor under 2^31 elements; two
copies while the map clones it) and a band's work; ``bench/hf_load_memory.py`` measures it.

A folder the map does not give the names or shapes of (Mixtral's fused-experts layout, a
damaged or disagreeing set) returns ``False`` here; ``load_hf_weights`` then reads it through
``from_hf``, whose checks name what is wrong.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from hybrid.interop.shards import weight_files
from hybrid.optim import spec_of

IGNORED = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
"""Buffers some transformers versions saved beside the weights: no parameter's."""

BAND = 2**22
"""Elements of an index worked on at once: 16 MB of int32, whatever the tensor."""

Reader = Callable[[str, Any, tuple[slice, ...]], torch.Tensor]
"""(HF name, ``get_slice`` handle, the block) -> the block's tensor; a test wraps it to count."""


def read_block(name: str, handle, block: tuple[slice, ...]) -> torch.Tensor:
    return handle[block]


def load_slices(hf_dir: str, run_model, source, interop, params: dict, groups,
                reader: Reader = read_block) -> bool:
    """Copy this rank's slice of every parameter of ``params`` (global name -> parameter)
    from ``hf_dir``; False (nothing copied) when the folder is not as ``interop.to_hf``
    names and shapes it."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        handles = {}
        for path in weight_files(Path(hf_dir)):
            opened = stack.enter_context(safe_open(str(path), framework="pt"))
            handles.update({name: opened for name in opened.keys()})
        shapes = _expected_shapes(run_model, source, interop)
        if shapes is None or not _names_fit(handles, shapes, run_model):
            return False
        for theirs, (want, positions) in shapes.items():
            stored = _stored(theirs, handles)
            found = tuple(handles[stored].get_slice(stored).get_shape())
            if found != want and not (positions and found[1:] == want[1:] and
                                      found[0] >= want[0]):
                return False
        for name, param in params.items():
            _load_one(name, param, run_model, interop, handles, groups, reader)
    return True


def _meta_weights(model) -> dict[str, torch.Tensor]:
    from hybrid.planning.params import model_param_specs

    return {name: torch.empty(spec.shape, device="meta")
            for name, spec in model_param_specs(model).items()}


def _expected_shapes(run_model, source, interop) -> Optional[dict]:
    """HF name -> (its shape for the run's model, whether it is a learned-positions table the
    file may hold more rows of); None when the map cannot name them (Mixtral's fused
    experts are not what it writes)."""
    try:
        ran = interop.to_hf(_meta_weights(run_model), run_model)
        shipped = interop.to_hf(_meta_weights(source), source)
    except Exception:  # noqa: BLE001 - a map that needs values (an expert bias): read whole
        return None
    return {name: (tuple(t.shape), tuple(shipped[name].shape) != tuple(t.shape))
            for name, t in ran.items()}


def _stored(name: str, handles: dict) -> str:
    """The name as the files hold it (GPT2Model's files lack ``transformer.``)."""
    if name in handles or not name.startswith("transformer."):
        return name
    return name[len("transformer."):]


def _names_fit(handles: dict, shapes: dict, model) -> bool:
    """Every tensor the map names is stored, and every stored one is named (buffers and a tied
    model's copy of the embedding aside)."""
    stored = {_stored(n, handles) for n in shapes}
    if not stored <= set(handles):
        return False
    extra = {n for n in set(handles) - stored if not n.endswith(IGNORED)}
    return extra <= ({"lm_head.weight"} if model.tie_embeddings else set())


def _load_one(name: str, param, model, interop, handles: dict, groups, reader: Reader) -> None:
    """This rank's slice of parameter ``name``: zeros where no HF tensor has elements (the
    vocabulary's padding rows), read block by block from the HF tensors that hold it."""
    spec = spec_of(param)
    tp, ep = groups.layout.tp, groups.layout.ep
    local = spec.local_shape(tp, ep)
    start = spec.local_offset(groups.tp_rank, tp, groups.expert.rank(), ep)
    dtype = torch.int32 if param.numel() * tp * ep < 2**31 else torch.int64
    weights = _meta_weights(model)
    weights[name] = torch.arange(weights[name].numel(), dtype=dtype).reshape(spec.shape)
    out = param.data  # written in place: no second copy of the slice
    out.zero_()
    mapped = interop.to_hf(weights, model)  # its own copies: the parameter's index goes now
    del weights
    for theirs in list(mapped):
        index = mapped.pop(theirs)
        if index.device.type == "meta":
            continue
        stored = _stored(theirs, handles)
        _read_into(out, index, spec.shape, start, local,
                   lambda block, s=stored: reader(s, handles[s].get_slice(s), block))
        del index


def _read_into(out, index, shape, start, local, read) -> None:
    """Copy into ``out`` the elements of HF tensor ``index`` (the parameter's element numbers
    at each HF position) that fall in this rank's box ``start`` + ``local``. Worked in bands of
    ``index``'s first dimension, so what it holds beyond ``index`` is a band's, not a tensor's."""
    band = max(1, BAND // max(1, index[0].numel())) if index.dim() else 1
    wanted = [torch.zeros(size, dtype=torch.bool) for size in index.shape]
    for first in range(0, max(1, index.shape[0] if index.dim() else 1), band):
        inside = _inside(index[first:first + band] if index.dim() else index, shape, start,
                         local)
        for d in range(inside.dim()):
            hit = inside.movedim(d, 0).reshape(inside.shape[d], -1).any(1)
            if d == 0:
                wanted[0][first:first + band] = hit
            else:
                wanted[d] |= hit
    runs = [_runs(torch.nonzero(w).flatten().tolist()) for w in wanted]
    if runs:  # the first dimension's runs cut into bands too
        runs[0] = [slice(i, min(i + band, r.stop)) for r in runs[0]
                   for i in range(r.start, r.stop, band)]
    for block in itertools.product(*runs):
        positions = index[block]
        keep = _inside(positions, shape, start, local)  # all of it where the box is a product
        data = read(block)
        local_flat = torch.zeros(positions.shape, dtype=index.dtype)  # in place: one copy
        for d, s in enumerate(start):
            local_flat.mul_(local[d]).add_(_coordinate(positions, shape, d)).sub_(s)
        del positions
        if bool(keep.all()):
            out.view(-1)[local_flat.flatten()] = data.flatten().to(out.dtype)
        else:
            out.view(-1)[local_flat[keep]] = data[keep].to(out.dtype)


def _inside(index: torch.Tensor, shape, start, local) -> torch.Tensor:
    """Where element numbers ``index`` fall in the box ``start`` + ``local`` of ``shape``."""
    inside = torch.ones(index.shape, dtype=torch.bool)
    for d, (s, n) in enumerate(zip(start, local)):
        if n < shape[d]:  # one coordinate at a time: a band's index, not its coordinates
            c = _coordinate(index, shape, d)
            inside &= (c >= s) & (c < s + n)
    return inside


def _coordinate(index: torch.Tensor, shape, dim: int) -> torch.Tensor:
    """Dimension ``dim``'s coordinate of flat element numbers ``index`` in a tensor of
    ``shape``."""
    stride = 1
    for size in shape[dim + 1:]:
        stride *= size
    return (index // stride).remainder_(shape[dim])


def _runs(indices: list[int]) -> list[slice]:
    """Sorted indices as contiguous slices: ``[0, 1, 2, 7, 8]`` -> ``[0:3, 7:9]``."""
    runs: list[slice] = []
    for i in indices:
        if runs and runs[-1].stop == i:
            runs[-1] = slice(runs[-1].start, i + 1)
        else:
            runs.append(slice(i, i + 1))
    return runs
