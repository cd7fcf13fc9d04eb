"""Checkpoints to HF directories and back (``hybrid-ckpt export --format hf`` and ``import``).

Both go one tensor at a time (``hybrid.interop.hf_stream``). Export reads the model of a
checkpoint of any layout and writes ``model.safetensors`` (or shards and their index),
``config.json`` and, when the run's data recorded an HF tokenizer, its
``tokenizer.json`` with a ``tokenizer_config.json``. Import writes a model-only checkpoint
(``OUT/step_00000000``, ``hybrid.checkpoint.weights``) holding the real vocabulary, with the HF
directory's tokenizer; ``checkpoint.init_from=OUT`` starts a run from it on any layout.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

import dataclasses
import importlib

from hybrid.checkpoint.store import model_shape
from hybrid.interop.hf_dir import (ConversionError, hf_config as read_config, hf_tokenizer,
                                   read_hf_weights, require_safetensors, write_hf_dir)
from hybrid.planning.config import ModelConfig
from hybrid.planning.model_config import setting_paths
from hybrid.planning.moved_keys import get_path
from hybrid.planning.models import MODELS, family_for_hf, model_spec


def name_map(spec):
    """The module of family ``spec``'s HF name map and config (``hybrid/interop/gpt2.py``'s
    functions: ``to_hf``, ``from_hf``, ``hf_config``, ``model_fields``)."""
    if spec.hf_module is None:
        raise ConversionError(f"model.family={spec.name} has no HF conversion")
    return importlib.import_module(spec.hf_module)


def model_config_of(manifest: dict) -> ModelConfig:
    """The ``ModelConfig`` a checkpoint was saved with (trained or imported)."""
    return ModelConfig(**manifest["config"]["model"])


def export_hf(path: Path, manifest: dict, out: str, max_shard_bytes: Optional[int] = None
              ) -> dict:
    """Write checkpoint ``path`` as an HF directory ``out`` (shards of at most
    ``max_shard_bytes``), one tensor at a time (``hybrid.interop.hf_stream``); what was
    written."""
    from hybrid.checkpoint.weights import checkpoint_tokenizer
    from hybrid.interop.hf_stream import streamed_export
    from hybrid.planning.models.moe import is_expert_bias

    require_safetensors()  # before the weights are read: a base install is told at once
    model = model_config_of(manifest)
    interop = name_map(model_spec(model))
    biases = [name[len("model."):] for name in manifest["tensors"]
              if is_expert_bias(name[len("model."):])]
    tensors, write = streamed_export(path, model, interop, biases)
    record, tokenizer_json = checkpoint_tokenizer(path, manifest)
    eod = None if record is None else record.get("eod")
    eod_token = None
    if tokenizer_json is not None and eod is not None:
        from tokenizers import Tokenizer

        eod_token = Tokenizer.from_str(tokenizer_json).id_to_token(eod)
    config = interop.hf_config(model, eod)
    config.update({key: value for key, value in source_hf_values(manifest).items()
                   if key != "eos_token_id" or eod is None})  # the tokenizer's end wins
    if not model_spec(model).learned_positions:  # the context the source was made for
        config["max_position_embeddings"] = source_positions(manifest, model.seq_len)
    write_hf_dir(out, tensors, config, tokenizer_json, eod_token, model.seq_len,
                 max_shard_bytes, write_weights=write)
    return {"parameters": sum(t.numel() for t in tensors.values()),
            "architecture": interop.hf_config(model)["architectures"][0],
            "tokenizer": None if tokenizer_json is None else record.get("source"),
            "bytes_tokenizer": record is not None and record.get("kind") == "bytes"}


def source_positions(manifest: dict, seq_len: int) -> int:
    """The positions a rotary model was made for: an imported model's, or those of the
    checkpoint its run started from (``checkpoint.init_from``) or of the HF folder
    (``model.from_hf``), when it is still there, at least the run's own ``seq_len``."""
    from hybrid.checkpoint.store import CheckpointError, read_manifest, resolve_resume

    config = manifest.get("config") or {}
    source = (config.get("checkpoint") or {}).get("init_from")
    found = (config.get("model") or {}).get("seq_len", seq_len)
    hf_dir = (config.get("model") or {}).get("from_hf")
    if hf_dir is not None and Path(hf_dir, "config.json").is_file():
        try:
            shipped = read_config(hf_dir)
            spec = family_for_hf(shipped.get("model_type")) or MODELS["gpt2"]
            found = max(found, name_map(spec).model_fields(shipped, hf_dir)["seq_len"])
        except (ConversionError, KeyError):
            pass  # changed since into something unreadable: the run's own context is known
    if source is not None:
        try:
            start = resolve_resume(source, Path(source), field="checkpoint.init_from")
            found = max(found, source_positions(read_manifest(start), seq_len))
        except CheckpointError:
            pass  # moved or removed since: the run's own context is all that is known
    return max(found, seq_len)


CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "max_window_layers")
"""``config.json`` values hybrid does not model (the special token ids generation reads;
Qwen's ``max_window_layers``, which no layer uses with its window off): an import keeps the
source's in the checkpoint (``config.hf``) and an export writes them back."""


def carried_values(config: dict) -> dict:
    """The ``CARRIED`` values an HF ``config.json`` sets (not null)."""
    return {key: config[key] for key in CARRIED if config.get(key) is not None}


def source_hf_values(manifest: dict) -> dict:
    """The ``CARRIED`` values of the HF model a checkpoint came from: an imported one's own,
    else those of the checkpoint its run started from (``checkpoint.init_from``) or of the HF
    folder (``model.from_hf``), when still there; {} when none is known."""
    from hybrid.checkpoint.store import CheckpointError, read_manifest, resolve_resume

    config = manifest.get("config") or {}
    if "hf" in config:
        return dict(config["hf"])
    hf_dir = (config.get("model") or {}).get("from_hf")
    source = (config.get("checkpoint") or {}).get("init_from")
    try:
        if hf_dir is not None and Path(hf_dir, "config.json").is_file():
            return carried_values(read_config(hf_dir))
        if source is not None:
            start = resolve_resume(source, Path(source), field="checkpoint.init_from")
            return source_hf_values(read_manifest(start))
    except (ConversionError, CheckpointError):
        pass  # changed or moved since: hybrid's own values stand
    return {}


def hf_source(hf_dir: str) -> tuple[ModelConfig, object, dict]:
    """(model config, the family's HF map, config.json) of an HF directory, checked before
    any tensor is read."""
    config = read_config(hf_dir)
    # An unknown model_type goes to GPT-2's map, whose refusal names it.
    spec = family_for_hf(config.get("model_type")) or MODELS["gpt2"]
    interop = name_map(spec)
    try:
        fields = interop.model_fields(config, hf_dir)
    except KeyError as err:  # model_fields reads config.json alone: a setting it lacks
        raise ConversionError(f"{hf_dir}: config.json has no {err.args[0]!r}, which a "
                              f"{config.get('model_type')} config needs; use the config.json "
                              f"saved with the model") from None
    return ModelConfig(**fields, family=spec.name, vocab_pad_multiple=1), interop, config


def hf_tokenizer_record(hf_dir: str, model: ModelConfig, config: dict
                        ) -> tuple[Optional[dict], Optional[str]]:
    """(tokenizer record, tokenizer JSON) of an HF directory; (None, None) without one."""
    found = hf_tokenizer(hf_dir, model.vocab)
    if found is None:
        return None, None
    tokenizer, tokenizer_json, eos = found
    return _record(tokenizer, tokenizer_json, eos, hf_dir, config), tokenizer_json


def hf_model(hf_dir: str) -> tuple[ModelConfig, dict, Optional[dict], Optional[str]]:
    """(model config, hybrid weights with the real vocabulary, tokenizer record, tokenizer
    JSON) of an HF directory, read whole (its config checked before any tensor is read,
    every tensor's shape against the config, then the tokenizer against the model)."""
    model, interop, config = hf_source(hf_dir)
    weights = interop.from_hf(read_hf_weights(hf_dir), model)
    return model, weights, *hf_tokenizer_record(hf_dir, model, config)


def import_hf(hf_dir: str, out: str) -> Path:
    """``hf_dir`` as a model-only hybrid checkpoint under ``out``; its path. Safetensors are
    converted one tensor at a time (``hybrid.interop.hf_stream``); a ``pytorch_model.bin``,
    which loads only whole, whole."""
    target = Path(out)
    if target.exists() and any(target.iterdir()):
        raise ConversionError(f"{out} exists and is not empty; choose another folder")
    model, interop, config = hf_source(hf_dir)
    record, tokenizer_json = hf_tokenizer_record(hf_dir, model, config)
    from hybrid.checkpoint.weights import write_weights_checkpoint  # torch: once data is read
    from hybrid.interop.hf_stream import streamed_import

    manifest = dict(model_shape=model_shape(model),
                    config={"model": dataclasses.asdict(model), "hf": carried_values(config)},
                    source=str(Path(hf_dir).resolve()), tokenizer=record,
                    tokenizer_json=tokenizer_json)
    if not has_safetensors(hf_dir):
        weights = interop.from_hf(read_hf_weights(hf_dir), model)
        return write_weights_checkpoint(target, weights, **manifest)
    require_safetensors()
    return streamed_import(hf_dir, model, interop, target, **manifest)


def has_safetensors(hf_dir: str) -> bool:
    from hybrid.interop.shards import INDEX

    folder = Path(hf_dir).expanduser()
    return (folder / "model.safetensors").is_file() or (folder / INDEX).is_file()


SHAPE_OVERRIDES = ("family", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab",
                   "seq_len", "tie_embeddings", "norm_eps", "rope_base")
"""Always written, whatever the base config says: the shape a reader checks first."""
MOE_OVERRIDES = ("moe.experts", "moe.topk", "moe.ffn_hidden", "moe.every", "moe.aux_loss")
"""Added for a model with experts (an imported Mixtral); its aux-loss coefficient too, so a
run started from the printed line trains with the coefficient the model came with."""
RUN_FIELDS = ("name", "from_hf", "vocab_pad_multiple", "recompute")
"""``ModelConfig`` fields that are the run's, not the model's (as ``model.from_hf`` keeps
them): an import's ``vocab_pad_multiple=1`` is no advice for training."""


def shape_overrides(model: ModelConfig) -> list[str]:
    """The ``model.*`` overrides that give a config ``model``'s shape and settings: what
    ``checkpoint.init_from`` of an imported model needs. Besides ``SHAPE_OVERRIDES`` (and
    ``MOE_OVERRIDES`` for experts), every other field that differs from the base config's
    model (``ModelConfig()``, which ``conf/model/tiny.yaml`` repeats): a variant's
    ``head_dim``, ``qkv_bias``, ``qk_norm``, rope scaling, window."""
    base = ModelConfig()
    always = SHAPE_OVERRIDES + (MOE_OVERRIDES if model.moe.experts else ())
    names = [*always, *(name for name in setting_paths()
                        if name not in always and name not in RUN_FIELDS
                        and get_path(model, name) != get_path(base, name))]
    return [f"model.{name}={override_text(get_path(model, name))}" for name in names
            if name not in always or get_path(model, name) is not None]


def override_text(value: object) -> str:
    """``value`` as a Hydra override writes it (``true``, ``null``, ``[1,2]``: no space, so
    that the printed command line keeps it one argument)."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_text(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _record(tokenizer, tokenizer_json: str, eos: Optional[str], hf_dir: str,
            config: dict) -> dict:
    """The tokenizer record of an HF directory's ``tokenizer.json`` (``TokenizerInfo``'s
    fields; end of document: its eos token, else config.json's eos_token_id)."""
    eod = tokenizer.token_to_id(eos) if eos else config.get("eos_token_id")
    return {"kind": "hf", "source": str(hf_dir),
            "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True), "eod": eod,
            "sha256": hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()}
