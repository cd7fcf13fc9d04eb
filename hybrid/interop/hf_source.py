"""``model.from_hf=HF_DIR``: train an HF model directory with no conversion step.

Before launch (``with_hf_shape``, no torch) the model's shape comes from the folder's
``config.json`` through its family's HF map (the one ``hybrid-ckpt import`` uses);
``model.seq_len``, the vocabulary padding, recompute and the layout stay the user's. GPT-2's
learned positions bound ``model.seq_len`` by ``n_positions`` (refused past it, in one line).
On every rank (``load_hf_weights``) each parameter's TP/EP slice of this pipeline stage is
read from the folder's safetensors with ``get_slice`` (``hybrid.interop.hf_slices``), found
through the same map: no rank reads or holds the whole model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

from hybrid.interop.hf_dir import ConversionError, hf_config
from hybrid.planning.models import MODELS, family_for_hf, model_spec

KEPT = ("name", "seq_len", "vocab_pad_multiple", "recompute", "from_hf")
"""``ModelConfig`` fields that stay the user's when the shape comes from an HF folder."""


def source_model(hf_dir: str):
    """The ``ModelConfig`` of HF folder ``hf_dir`` as it ships (its own context)."""
    from hybrid.interop.convert import name_map
    from hybrid.planning.config import ModelConfig

    config = hf_config(hf_dir)
    spec = family_for_hf(config.get("model_type")) or MODELS["gpt2"]
    fields = name_map(spec).model_fields(config, hf_dir)
    return ModelConfig(**fields, family=spec.name, vocab_pad_multiple=1)


def with_hf_shape(cfg, typed: Iterable[str] = ()):
    """``cfg`` (a ``Config``) with ``model.from_hf``'s shape; ``cfg`` itself without one.
    ``typed``: the command line's overrides (Hydra's ``overrides.task``). A shape field the
    user typed that differs from the folder's is refused; a preset's (``model=...``) is
    replaced, as documented."""
    wanted = cfg.model
    if wanted.from_hf is None:
        return cfg
    if cfg.checkpoint.init_from is not None:
        raise ConversionError(f"model.from_hf={wanted.from_hf} and checkpoint.init_from="
                              f"{cfg.checkpoint.init_from} both give the starting weights; "
                              f"drop one")
    source = source_model(wanted.from_hf)
    if model_spec(source).learned_positions and wanted.seq_len > source.seq_len:
        raise ConversionError(f"model.seq_len={wanted.seq_len}: {wanted.from_hf} has learned "
                              f"positions for {source.seq_len} tokens; set model.seq_len <= "
                              f"{source.seq_len}")
    shape = {f.name: getattr(source, f.name) for f in dataclasses.fields(source)
             if f.name not in KEPT}
    _refuse_typed_shape(typed_model_fields(typed), wanted, source)
    model = dataclasses.replace(wanted, **shape, name=f"hf:{Path(wanted.from_hf).name}")
    return dataclasses.replace(cfg, model=model)


def typed_model_fields(overrides: Iterable[str]) -> list[str]:
    """The ``model.FIELD`` names among command-line ``overrides`` (``+``/``++`` too)."""
    keys = (override.lstrip("+~").split("=", 1)[0] for override in overrides)
    return [key[len("model."):] for key in keys if key.startswith("model.")]


def _refuse_typed_shape(typed: list[str], wanted, source) -> None:
    """A shape field the user typed (``moe.topk`` for the MoE ones) that the HF folder's
    config (``source``) sets otherwise: training would silently use the folder's, so it is
    refused in one line."""
    from hybrid.checkpoint.shape import LLAMA3_FACTORS, WEIGHT_FREE_FIELDS
    from hybrid.planning.model_config import setting_paths
    from hybrid.planning.moved_keys import get_path

    shape = {name: get_path(source, name) for name in setting_paths() if name not in KEPT}
    for name in typed:
        value = get_path(wanted, name) if name in shape else None
        if name not in shape or value == shape[name]:
            continue
        fix = (f"drop model.{name}=... (model.seq_len, vocab_pad_multiple and recompute stay "
               f"yours)")
        if name in WEIGHT_FREE_FIELDS + LLAMA3_FACTORS:  # a setting a fine-tune may change
            fix = (f"drop model.{name}=..., or import the folder (hybrid-ckpt import "
                   f"{wanted.from_hf} OUT) and train with the use: line it prints plus "
                   f"model.{name}={value} (no weight depends on it)")
        raise ConversionError(
            f"model.{name}: the HF folder {wanted.from_hf} has {name}={shape[name]}, the "
            f"config {name}={value}; model.from_hf takes the shape from the folder's "
            f"config.json: {fix}")


def load_hf_weights(hf_dir: str, model_cfg, params: dict, groups, reader=None) -> None:
    """The weights of HF folder ``hf_dir`` into this rank's ``params`` (global name ->
    parameter: this pipeline stage's, each taking its TP/EP slice). Each rank reads only its
    slices (``hybrid.interop.hf_slices``; ``reader``: its block reader, a test counts with
    it); a folder the export map does not name goes through ``from_hf`` whole."""
    from hybrid.checkpoint.weights import fit_positions
    from hybrid.interop.convert import name_map
    from hybrid.interop.gpt2 import pad_vocabulary
    from hybrid.interop.hf_dir import read_hf_weights
    from hybrid.interop.hf_slices import load_slices, read_block
    from hybrid.model.shards import load_global_weights

    source = source_model(hf_dir)
    interop = name_map(model_spec(source))
    if load_slices(hf_dir, model_cfg, source, interop, params, groups, reader or read_block):
        return
    weights = interop.from_hf(read_hf_weights(hf_dir), source)
    weights = pad_vocabulary(fit_positions(weights, model_cfg.seq_len), model_cfg.padded_vocab)
    load_global_weights(list(params.values()),
                        {name: t for name, t in weights.items() if name in params}, groups)
