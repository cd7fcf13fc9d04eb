"""HF model directories on disk: read one (offline, no transformers needed) and write one that
``transformers.GPT2LMHeadModel.from_pretrained`` loads with no missing or unexpected key.

Reading takes ``config.json`` and ``model.safetensors`` (or a ``pytorch_model.bin``, loaded
with ``torch.load(weights_only=True)``, which refuses a pickle that carries code); sharded
checkpoints are refused. A local directory never reaches the network. ``hf_config`` checks a
directory without importing torch, so a bad one is refused at once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from hybrid.errors import UserError
from hybrid.planning.models import family_for_hf

WEIGHTS = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILE = "tokenizer.json"


class ConversionError(UserError):
    """A model or a directory the conversion cannot represent: one line saying why."""


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
    if family_for_hf(config.get("model_type")) is None:
        raise ConversionError(f"{path} holds a {config.get('model_type')!r} model; only GPT-2 "
                              f"and Llama (model_type gpt2, llama) convert")
    if any(folder.glob("*.index.json")):
        raise ConversionError(f"{path} holds a sharded checkpoint; merge it into one "
                              f"model.safetensors (save_pretrained(max_shard_size='100GB'))")
    if not any((folder / name).is_file() for name in WEIGHTS):
        raise ConversionError(f"{path} has neither {' nor '.join(WEIGHTS)}")
    return config


def read_hf_weights(path: str) -> dict:
    """The tensors (by HF name) of the checked HF directory ``path``."""
    import torch

    folder = Path(path).expanduser()
    if (folder / WEIGHTS[0]).is_file():
        return _safetensors().load_file(str(folder / WEIGHTS[0]))
    try:
        return torch.load(folder / WEIGHTS[1], map_location="cpu", weights_only=True)
    except Exception as err:  # an UnpicklingError names what it refused
        raise ConversionError(f"{folder / WEIGHTS[1]} cannot be loaded as weights only "
                              f"({str(err).splitlines()[0]}); convert it to "
                              f"model.safetensors") from None


def write_hf_dir(out: str, tensors: dict, config: dict,
                 tokenizer_json: Optional[str] = None, eod_token: Optional[str] = None,
                 max_length: Optional[int] = None) -> None:
    """Write ``out`` whole or not at all: a temporary folder beside it, renamed at the end."""
    save_file = _safetensors().save_file
    target = Path(out)
    if target.exists() and any(target.iterdir()):
        raise ConversionError(f"{out} exists and is not empty; choose another folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_file(tensors, str(staging / WEIGHTS[0]), metadata={"format": "pt"})
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


def hf_tokenizer(path: str) -> Optional[tuple[str, Optional[str]]]:
    """(tokenizer JSON, end-of-document token) of an HF directory, None without a
    ``tokenizer.json``."""
    folder = Path(path)
    if not (folder / TOKENIZER_FILE).is_file():
        return None
    eos = None
    config = folder / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
    return (folder / TOKENIZER_FILE).read_text(), eos


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ConversionError("HF conversion needs safetensors: pip install -e '.[hf]'") from None
    return safetensors.torch
