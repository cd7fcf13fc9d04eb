"""A checkpoint's model weights whole, without a process group, and checkpoints of weights only.

``read_model_weights`` reads the model tensors of any layout's checkpoint at their global
shapes (``hybrid-ckpt export``, ``hybrid-generate``, ``checkpoint.init_from``).
``write_weights_checkpoint`` writes a checkpoint that holds a model and nothing else (no
optimizer state, step 0): what ``hybrid-ckpt import`` makes of an HF model. It is an ordinary
complete checkpoint (``OUT/step_00000000`` with DCP files and the manifest, written under a
temporary name and renamed), marked ``"kind": "weights"``: ``checkpoint.init_from`` starts a
run from it; ``checkpoint.resume_from`` refuses it, as there is no run to continue.

A checkpoint also carries the tokenizer its data was made with (``tokenizer.json`` beside
the manifest, and the record in the manifest), so that export and generation can decode.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlanner

from hybrid.checkpoint.dcp_io import SafeReader, file_checksums, read_metadata
from hybrid.checkpoint.store import (FORMAT_VERSION, TOKENIZER_FILE, WEIGHTS_KIND,
                                     checkpoint_name, partial_name, write_manifest)


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model tensors of checkpoint ``path`` (global names, full shapes, any layout)."""
    metadata = read_metadata(path)
    state = {key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
             for key, item in metadata.state_dict_metadata.items() if key.startswith("model.")}
    with single_process():
        dcp.load(state, storage_reader=SafeReader(path), no_dist=True)
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}


POSITIONS = "embedding.position_embeddings"
"""A learned position table (GPT-2's): rows are positions."""


def fit_positions(weights: dict[str, torch.Tensor], seq_len: int) -> dict[str, torch.Tensor]:
    """``weights`` for a model of ``seq_len`` positions: a learned table's first ``seq_len``
    rows, as HF slices ``wpe`` for shorter inputs (more rows were refused before launch)."""
    table = weights.get(POSITIONS)
    if table is None or table.shape[0] <= seq_len:
        return weights
    return {**weights, POSITIONS: table[:seq_len]}


def check_no_foreign_tensors(weights: dict, model_names: set, path: Path) -> None:
    """Every tensor of checkpoint ``path`` has a parameter in the whole model (every stage's
    names, ``model_names``): one it has no place for means another model (a q/k/v bias, a
    q/k norm), never a tensor to drop (a rank keeps only its own stage's, so the whole model
    is asked)."""
    foreign = sorted(set(weights) - model_names)
    if foreign:
        from hybrid.checkpoint.store import CheckpointError

        raise CheckpointError(f"checkpoint {path} holds {len(foreign)} tensors this model has "
                              f"no parameter for (first: {foreign[0]}); set the model.* fields "
                              f"hybrid-ckpt show {path} prints")


def checkpoint_tokenizer(path: Path, manifest: dict) -> tuple[Optional[dict], Optional[str]]:
    """(the tokenizer record, its JSON) a checkpoint carries; (None, None) for none."""
    file = Path(path) / TOKENIZER_FILE
    return manifest.get("tokenizer"), file.read_text() if file.is_file() else None


def write_weights_checkpoint(directory: Path, weights: dict[str, torch.Tensor], *,
                             model_shape: dict, config: Optional[dict], source: str,
                             tokenizer: Optional[dict] = None,
                             tokenizer_json: Optional[str] = None,
                             planner: Optional[SavePlanner] = None) -> Path:
    """``directory/step_00000000``: the weights as a complete model-only checkpoint.
    ``planner``: one that makes each tensor as DCP writes it (``weights`` are then meta
    tensors, ``hybrid.interop.hf_stream``); DCP's serial loader then asks for one at a time."""
    directory = Path(directory)
    partial, final = directory / partial_name(0), directory / checkpoint_name(0)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        state = {f"model.{name}": tensor.contiguous() for name, tensor in weights.items()}
        with single_process():
            writer = FileSystemWriter(partial, per_thread_copy_ahead=0)  # no read-ahead
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        if tokenizer_json is not None:
            (partial / TOKENIZER_FILE).write_text(tokenizer_json)
        write_manifest(partial, _manifest(partial, weights, model_shape, config, source,
                                          tokenizer))
        partial.rename(final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final


def _manifest(partial: Path, weights: dict, model_shape: dict, config: Optional[dict],
              source: str, tokenizer: Optional[dict]) -> dict:
    tensors = {f"model.{name}": {"shape": list(t.shape),
                                 "dtype": str(t.dtype).removeprefix("torch."),
                                 "bytes": t.numel() * t.element_size()}
               for name, t in sorted(weights.items())}
    return {"format": FORMAT_VERSION, "kind": WEIGHTS_KIND, "step": 0, "consumed_samples": 0,
            "source": source,
            "layout": {"dp": 1, "tp": 1, "pp": 1, "vpp": 1, "zero": 0, "schedule": "none",
                       "world": 1},
            "model": model_shape, "config": config, "tensors": tensors,
            "tokenizer": tokenizer, "files": file_checksums(partial, 0)}


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when asked for exactly that (``no_dist``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
