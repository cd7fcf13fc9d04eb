"""Streamed conversion: ``hybrid-ckpt import`` and ``export --format hf`` one tensor at a time.

Neither direction holds the model. Both run the family's own map (``from_hf`` or ``to_hf``,
the one the whole-model conversion runs) on ``meta`` tensors (shapes and dtypes, no storage):
once to check names and shapes and learn what comes out, and once per input with that input
*tagged* by a dtype every other promotes to (``complex128``): the outputs that come out tagged
are made from it. So each output is made of a known set of inputs, however the map renames,
fuses (Llama's q/k/v), stacks (Mixtral's experts) or splits them, and to make one output only
its inputs are read, the map run with them real and the rest meta.

- Import reads those inputs with ``safetensors.safe_open`` (memory-mapped: a tensor's pages go
  when it does) and DCP writes each output as its planner asks for it (``_StreamPlanner``),
  one at a time (``per_thread_copy_ahead=0``: DCP's serial loader, never read-ahead).
- Export reads the inputs from the checkpoint one DCP load per tensor and writes each HF shard
  as a stream: the safetensors header first (every shape and offset is known from the meta
  run), then each tensor's bytes as it is made, so no shard is ever held whole (safetensors'
  own ``save_file`` copies a shard into bytes before writing it).

``bench/hf_load_memory.py`` measures both against ``transformers``' ``from_pretrained`` and
``save_pretrained``; ``tests/test_hf_stream.py`` holds the results equal, tensor for tensor,
to the whole-model conversion's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from hybrid.interop.errors import ConversionError

TAG = torch.complex128
"""The dtype a traced input carries: any arithmetic with a real dtype promotes to it."""

Convert = Callable[[dict, object], dict]
"""A family's ``from_hf`` or ``to_hf``: (tensors by name, ``ModelConfig``) -> tensors by name."""


def meta_like(shape, dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def sources(convert: Convert, inputs: dict, model, fixed: Optional[dict] = None
            ) -> dict[str, set[str]]:
    """Output name -> the input names it is made of (``inputs``: meta tensors; ``fixed``:
    real tensors every run needs, never traced)."""
    fixed = fixed or {}
    made_of: dict[str, set[str]] = {}
    for name, tensor in inputs.items():
        if name in fixed:
            continue
        tagged = {**inputs, **fixed, name: meta_like(tensor.shape, TAG)}
        for out, made in convert(tagged, model).items():
            if made.dtype == TAG:
                made_of.setdefault(out, set()).add(name)
    return made_of


def make_one(convert: Convert, inputs: dict, model, made_of: set[str],
             read: Callable[[str], torch.Tensor], fixed: Optional[dict] = None) -> dict:
    """Every output that ``convert`` makes real when the inputs ``made_of`` are read (the
    others meta): the one asked for, and those made of the same inputs (q, k and v of one
    fused QKV)."""
    real = {name: read(name) for name in sorted(made_of)}
    done = convert({**inputs, **(fixed or {}), **real}, model)
    del real
    return {name: t for name, t in done.items() if t.device.type != "meta"}


# -- import: HF safetensors -> a model-only checkpoint -------------------------------------

def hf_headers(folder: Path) -> dict[str, tuple[Path, torch.Tensor]]:
    """HF name -> (its file, a meta tensor of its shape and dtype), from the headers alone."""
    from safetensors import SafetensorError, safe_open

    from hybrid.interop.shards import weight_files

    found = {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    part = handle.get_slice(name)
                    found[name] = (path, meta_like(part.get_shape(), _dtype(part.get_dtype())))
        except SafetensorError as err:
            raise ConversionError(f"{path} cannot be read ({err}): it is damaged or not "
                                  f"safetensors; copy the model again") from None
    return found


def read_hf_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of one safetensors file (mapped: its pages are the process's while it
    lives; the file is closed at once)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(name)


def streamed_import(hf_dir: str, model, interop, target: Path, **manifest) -> Path:
    """``hf_dir``'s weights as the model-only checkpoint ``target/step_00000000``, made and
    written one hybrid tensor at a time; ``manifest``: ``write_weights_checkpoint``'s."""
    from hybrid.checkpoint.weights import write_weights_checkpoint

    headers = hf_headers(Path(hf_dir).expanduser())
    inputs = {name: meta for name, (_, meta) in headers.items()}
    _check_tied_copy(headers, inputs, model)
    planned = interop.from_hf(inputs, model)  # names, shapes, every tensor used: at once
    made_of = sources(interop.from_hf, inputs, model)
    planned = {name: t for name, t in planned.items() if name in made_of}

    def make(name: str) -> torch.Tensor:
        return make_one(interop.from_hf, inputs, model, made_of[name],
                        lambda n: read_hf_tensor(headers[n][0], n))[name]

    return write_weights_checkpoint(target, planned, planner=_StreamPlanner(make), **manifest)


EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight", "wte.weight")
"""Where the families' files keep the embedding a tied ``lm_head.weight`` must equal."""


def _check_tied_copy(headers: dict, inputs: dict, model) -> None:
    """A tied model's files may hold ``lm_head.weight`` too (older transformers saved it):
    equal to the embedding it is dropped, as ``from_hf`` does; compared here, two tensors at
    a time, since the meta run cannot compare values."""
    if not model.tie_embeddings or "lm_head.weight" not in inputs:
        return
    embedding = next((n for n in EMBEDDINGS if n in inputs), None)
    read = lambda n: read_hf_tensor(headers[n][0], n)  # noqa: E731
    if embedding is not None and not torch.equal(read(embedding), read("lm_head.weight")):
        raise ConversionError(f"tie_word_embeddings is true but lm_head.weight differs from "
                              f"{embedding}; set tie_word_embeddings=false")
    del inputs["lm_head.weight"]


class _StreamPlanner(DefaultSavePlanner):
    """DCP's default planner over meta tensors: each tensor's data is made when the writer
    asks for it (``resolve_data``), written, and dropped before the next is made.

    Dropped by hand: DCP's writer (torch 2.13, ``_write_files_from_queue``) keeps every tensor
    it wrote in a dict until the file is done (for its safetensors format), which would hold
    the model. Its serial loader (``per_thread_copy_ahead=0``) asks for the next tensor only
    once the last is written in the default format (``torch.save``), so the last one's storage
    is freed then. ``tests/test_hf_stream.py`` reads every tensor back: a writer that read
    ahead, or read a tensor again, would fail it."""

    def __init__(self, make: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self._make, self._last = make, None

    def resolve_data(self, write_item):
        if self._last is not None:
            self._last.untyped_storage().resize_(0)
        self._last = self._make(write_item.index.fqn.removeprefix("model."))
        return self._last


def _dtype(name: str) -> torch.dtype:
    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
            "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
            "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}[name]


# -- export: a checkpoint of any layout -> HF shards ---------------------------------------

ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
             torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
             torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def checkpoint_inputs(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model tensors as meta tensors (global names; from its metadata)."""
    from hybrid.checkpoint.dcp_io import read_metadata

    return {key.removeprefix("model."): meta_like(item.size, item.properties.dtype)
            for key, item in read_metadata(path).state_dict_metadata.items()
            if key.startswith("model.")}


def read_checkpoint_tensor(path: Path, name: str, like: torch.Tensor) -> torch.Tensor:
    """One model tensor of checkpoint ``path`` at its global shape (any layout: DCP joins its
    chunks)."""
    import torch.distributed.checkpoint as dcp

    from hybrid.checkpoint.dcp_io import SafeReader
    from hybrid.checkpoint.weights import single_process

    state = {f"model.{name}": torch.empty(like.shape, dtype=like.dtype)}
    with single_process():
        dcp.load(state, storage_reader=SafeReader(path), no_dist=True)
    return state[f"model.{name}"]


def streamed_export(path: Path, model, interop, fixed_names: Iterable[str]
                    ) -> tuple[dict[str, torch.Tensor], Callable[[Path, int], None]]:
    """(the HF tensors as meta, a writer of them into a folder in shards of at most N bytes).
    ``fixed_names``: tensors read whole up front for the map to look at (Mixtral's expert
    biases, which must be zero)."""
    inputs = checkpoint_inputs(path)
    fixed = {n: read_checkpoint_tensor(path, n, inputs[n]) for n in fixed_names}
    planned = interop.to_hf({**inputs, **fixed}, model)
    made_of = sources(interop.to_hf, inputs, model, fixed)

    def write(folder: Path, max_bytes: int) -> None:
        from hybrid.interop.shards import INDEX, shard_names, shard_plan

        groups = shard_plan({n: _nbytes(t) for n, t in planned.items()}, max_bytes)
        files = shard_names(len(groups))
        for file, group in zip(files, groups):
            made: dict[str, torch.Tensor] = {}

            def tensor(name: str, group=group, made=made) -> torch.Tensor:
                if name not in made:
                    made.update({n: t for n, t in make_one(
                        interop.to_hf, inputs, model, made_of[name],
                        lambda n: read_checkpoint_tensor(path, n, inputs[n]), fixed).items()
                        if n in group})
                return made.pop(name)

            write_safetensors(folder / file, {n: planned[n] for n in group}, tensor)
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(_nbytes(t) for t in planned.values())},
                     "weight_map": {n: f for f, g in zip(files, groups) for n in g}}
            (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")

    return planned, write


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(file: Path, planned: dict[str, torch.Tensor],
                      tensor: Callable[[str], torch.Tensor]) -> None:
    """A safetensors file of ``planned``'s names, shapes and dtypes, written as a stream: the
    header (8 bytes of its length, the JSON padded to 8 bytes), then each tensor's bytes as
    ``tensor(name)`` makes it, in the header's order (the format's: offsets from the end of
    the header, each tensor after the last, no gaps)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, meta in planned.items():
        header[name] = {"dtype": ST_DTYPES[meta.dtype], "shape": list(meta.shape),
                        "data_offsets": [offset, offset + _nbytes(meta)]}
        offset += _nbytes(meta)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for name, meta in planned.items():
            data = tensor(name)
            if data.shape != meta.shape or data.dtype != meta.dtype:
                raise AssertionError(f"{name}: made {data.dtype} {list(data.shape)}, planned "
                                     f"{meta.dtype} {list(meta.shape)}")
            out.write(memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy()))
            del data
