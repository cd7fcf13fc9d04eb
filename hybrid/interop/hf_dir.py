"""HF model directories on disk: read one (offline, no transformers needed) and write one that
``transformers.GPT2LMHeadModel.from_pretrained`` loads with no missing or unexpected key.

Reading takes ``config.json`` and ``model.safetensors`` (or a ``pytorch_model.bin``, loaded
with ``torch.load(weights_only=True)``, which refuses a pickle that carries code), or the shards
of ``model.safetensors.index.json`` (``hybrid.interop.shards``), one tensor at a time. A local directory never reaches the network. ``hf_config`` checks a
directory without importing torch, so a bad one is refused at once; a damaged weights file, a
``tokenizer.json`` that is not one or cannot encode text (an empty vocabulary, ids past the
model's vocabulary) are refused in one line too.
"""

from __future__ import annotations

import json
import os
import shutil
from functools import partial
from pathlib import Path
from typing import Optional

from hybrid.interop.errors import ConversionError
from hybrid.planning.models import MODELS, family_for_hf

WEIGHTS = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILE = "tokenizer.json"


def hf_config(path: str) -> dict:
    """``config.json`` of the HF directory ``path`` (of a registered family: GPT-2, Llama),
    after checking the directory."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConversionError(f"{path} is not a folder; pass a local HF model directory (one "
                              f"holding config.json and model.safetensors)")
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{path} has no config.json: it is not an HF model directory")
    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError as err:
        raise ConversionError(f"{folder / 'config.json'} is not JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{folder / 'config.json'} holds a {type(config).__name__}, not "
                              f"an object of settings; use the config.json saved with the model")
    if family_for_hf(config.get("model_type")) is None:
        known = sorted({t for spec in MODELS.values()
                        for t in (spec.hf_model_type, *spec.hf_model_types_also) if t})
        if {"model", "train", "parallel"} <= set(config):  # hybrid's own config.json
            raise ConversionError(f"{path} is a hybrid run directory, not an HF model "
                                  f"directory (hybrid-ckpt import reads HF folders); train from "
                                  f"its checkpoint with checkpoint.init_from={path}, or write "
                                  f"it as an HF folder with hybrid-ckpt export {path} OUT "
                                  f"--format hf")
        if config.get("model_type") is None:
            raise ConversionError(f"{folder / 'config.json'} has no model_type, so no family "
                                  f"can read it; the registered model_types are "
                                  f"{', '.join(known)}: use the config.json saved with the "
                                  f"model, or add the model_type it is")
        raise ConversionError(f"{path} holds a {config.get('model_type')!r} model; the "
                              f"registered model_types are {', '.join(known)}")
    _check_sizes(config, folder / "config.json")
    from hybrid.interop.shards import INDEX, index_of

    if index_of(folder) is None and not any((folder / name).is_file() for name in WEIGHTS):
        raise ConversionError(f"{path} has neither {' nor '.join(WEIGHTS)} nor {INDEX}")
    return config


SIZE_KEYS = ("n_embd", "n_head", "n_layer", "n_positions", "n_inner", "vocab_size",
             "hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
             "intermediate_size", "max_position_embeddings", "head_dim", "num_local_experts",
             "num_experts_per_tok")
"""The sizes of the registered families' configs (GPT-2's, Llama's, Mixtral's): whole
numbers >= 1 where present (null: the family's default, as ``n_inner`` and ``head_dim``)."""


def _check_sizes(config: dict, file: Path) -> None:
    for key in SIZE_KEYS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ConversionError(f"{file}: {key}={value!r} must be a whole number >= 1; use "
                                  f"the config.json saved with the model")


def read_hf_weights(path: str) -> dict:
    """The tensors (by HF name) of the checked HF directory ``path``."""
    import torch

    from hybrid.interop.shards import INDEX, iter_tensors

    folder = Path(path).expanduser()
    if (folder / WEIGHTS[0]).is_file() or (folder / INDEX).is_file():
        require_safetensors()
        return dict(iter_tensors(folder))  # one file, or shard after shard
    try:
        return torch.load(folder / WEIGHTS[1], map_location="cpu", weights_only=True)
    except Exception as err:  # an UnpicklingError names what it refused
        raise ConversionError(f"{folder / WEIGHTS[1]} cannot be loaded as weights only "
                              f"({str(err).splitlines()[0]}); convert it to "
                              f"model.safetensors") from None


def write_hf_dir(out: str, tensors: dict, config: dict,
                 tokenizer_json: Optional[str] = None, eod_token: Optional[str] = None,
                 max_length: Optional[int] = None, max_shard_bytes: Optional[int] = None,
                 write_weights=None) -> None:
    """Write ``out`` whole or not at all: a temporary folder beside it, renamed at the end.
    The folder and its files get the modes ``mkdir`` and ``open`` give (0777 and 0666 less
    the umask). ``max_shard_bytes``: HF's shards and index, each file at most that.
    ``write_weights(folder, max_bytes)``: writes them instead of ``save_sharded`` (``tensors``
    are then meta: ``hybrid.interop.hf_stream``)."""
    from hybrid.interop.shards import save_sharded

    require_safetensors()
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise ConversionError(f"{out} exists and is not a folder; choose another folder")
    if target.exists() and any(target.iterdir()):
        raise ConversionError(f"{out} exists and is not empty; choose another folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)  # a killed export of this pid's
    try:
        staging.mkdir()  # not tempfile.mkdtemp: its 0700 would stay on the renamed folder
        limit = max_shard_bytes or sum(t.numel() * t.element_size() for t in tensors.values())
        (write_weights or partial(save_sharded, tensors))(staging, limit)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer_json is not None:
            (staging / TOKENIZER_FILE).write_text(tokenizer_json)
            (staging / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod_token,
                 "bos_token": eod_token, "model_max_length": max_length}, indent=2) + "\n")
        if target.exists():
            target.rmdir()
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def hf_tokenizer(path: str, model_vocab: int):
    """(tokenizer, its JSON, end-of-document token) of an HF directory, None without a
    ``tokenizer.json``; ``ConversionError`` for one that cannot encode text for the model."""
    from tokenizers import Tokenizer

    folder = Path(path)
    file = folder / TOKENIZER_FILE
    if not file.is_file():
        return None
    text = file.read_text()
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as err:  # the library raises a bare Exception for a malformed file
        raise ConversionError(f"{file} is not an HF tokenizer ({err}); give the model's own "
                              f"tokenizer.json, or remove it to import the weights alone"
                              ) from None
    _check_vocabulary(tokenizer, file, model_vocab)
    return tokenizer, text, _eos_token(folder / "tokenizer_config.json")


def _check_vocabulary(tokenizer, file: Path, model_vocab: int) -> None:
    """Text encodes to ids the model has: a vocabulary beyond its special tokens, no id past
    config.json's ``vocab_size``."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    if tokenizer.get_vocab_size(with_added_tokens=False) == 0:
        raise ConversionError(f"{file} has an empty vocabulary (special tokens only: "
                              f"{len(ids)}), so no text encodes to any token; give the model's own "
                              f"tokenizer.json, or remove it to import the weights alone")
    if max(ids) >= model_vocab:
        raise ConversionError(f"{file} has ids up to {max(ids)}, past config.json's "
                              f"vocab_size={model_vocab} (those tokens have no embedding); "
                              f"give the model's own tokenizer.json")


def _eos_token(config: Path) -> Optional[str]:
    """``tokenizer_config.json``'s ``eos_token`` (a string or ``{"content": ...}``), if any."""
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (ValueError, AttributeError):
        raise ConversionError(f"{config} is not a JSON object; fix it, or remove it (the "
                              f"end of document is then config.json's eos_token_id)") from None
    return eos.get("content") if isinstance(eos, dict) else eos


HF_EXTRA_MISSING = ("HF conversion needs the hf extra, and safetensors is not installed: "
                    "pip install -e '.[hf]' in a checkout of hybrid (or pip install 'hybrid[hf]')")
"""The one line of every HF path (import, export --format hf, generate from an HF directory)
on a base install; transformers is not needed by any of them (tokenizers is a base
dependency), only by the tests that load the result."""


def require_safetensors():
    """``safetensors.torch``, or ``ConversionError`` naming the ``[hf]`` extra."""
    try:
        import safetensors.torch
    except ImportError:
        raise ConversionError(HF_EXTRA_MISSING) from None
    return safetensors.torch
