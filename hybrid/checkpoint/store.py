"""Checkpoint directories on disk: naming, completeness, the manifest, resolution (pure).

A checkpoint is one directory ``step_00000005`` holding the files of
``torch.distributed.checkpoint`` (``*.distcp`` data, ``.metadata``) and hybrid's manifest
``hybrid.json`` (step, layout, config, model shape, tensors, and every data file's size and
CRC-32). It is written under a temporary name (``step_00000005.tmp``) and renamed only once
the manifest, written last, is in place: a directory with a ``step_*`` name and a manifest is
complete; anything else is an interrupted save, ignored and removed by the next save.

Everything here is plain file and JSON work, so ``hybrid-train`` can check a checkpoint before
any worker starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional
from hybrid.errors import UserError
from hybrid.planning.models import model_spec
from hybrid.planning.models.moe import is_expert_bias
from hybrid.planning.moe_config import nest_model
from hybrid.checkpoint.shape import MODEL_SHAPE_FIELDS, check_shape, model_shape  # noqa: F401

MANIFEST = "hybrid.json"
TOKENIZER_FILE = "tokenizer.json"
"""The data's tokenizer (HF JSON) a checkpoint carries beside its manifest, when it has one."""
WEIGHTS_KIND = "weights"
"""The manifest ``kind`` of a checkpoint that holds a model only (``hybrid-ckpt import``)."""
DCP_METADATA = ".metadata"
FORMAT_VERSION = 1
_NAME = re.compile(r"^step_(\d{8})$")


class CheckpointError(UserError):
    """A checkpoint cannot be used as asked: one line with the path and the fix."""


def checkpoint_dir(cfg, run_dir: Path) -> Path:
    """``checkpoint.dir``, or ``<run dir>/checkpoints`` when it is not set."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def partial_name(step: int) -> str:
    return checkpoint_name(step) + ".tmp"


def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint ``path``; ``CheckpointError`` if absent or unreadable."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST}: it is not a complete hybrid "
                              f"checkpoint") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}/{MANIFEST} cannot be read ({err}); the checkpoint is "
                              f"damaged: resume from an older one") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has manifest format {manifest.get('format')!r}, this "
                              f"hybrid reads {FORMAT_VERSION}")
    return manifest


def write_manifest(path: Path, manifest: dict) -> None:
    """Write the manifest through a temporary file, so it is either whole or absent."""
    tmp = Path(path) / (MANIFEST + ".tmp")
    with open(tmp, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, Path(path) / MANIFEST)


def is_complete(path: Path) -> bool:
    path = Path(path)
    return bool(_NAME.match(path.name)) and holds_checkpoint(path)


def holds_checkpoint(path: Path) -> bool:
    """``path`` holds a complete checkpoint's files, whatever its name."""
    return (Path(path) / MANIFEST).is_file() and (Path(path) / DCP_METADATA).is_file()


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and is_complete(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def newest_complete(directory: Path) -> Optional[Path]:
    found = complete_checkpoints(directory)
    return found[-1][1] if found else None


def resolve_resume(value: Optional[str], checkpoint_dir: Path, *,
                   field: str = "checkpoint.resume_from") -> Optional[Path]:
    """The checkpoint ``checkpoint.resume_from=value`` names, or None to start fresh.

    ``value``: None; ``auto`` (the newest complete checkpoint in ``checkpoint_dir``, None when
    there is none); a checkpoint directory (``step_*``, or any directory holding a complete
    checkpoint's files); or a run directory / checkpoint directory, whose newest complete
    checkpoint is taken.
    """
    if value is None:
        return None
    if value == "auto":
        return newest_complete(checkpoint_dir)
    path = Path(value).expanduser().resolve()
    field = f"{field}={value}"
    if not path.exists():
        raise CheckpointError(f"{field} does not exist; give a step_* checkpoint directory or "
                              f"a run directory")
    if _NAME.match(path.name):
        if not is_complete(path):
            raise CheckpointError(f"{field} {_incomplete(path)}; resume from an older step_* "
                                  f"directory")
        return path
    if holds_checkpoint(path):  # a checkpoint copied under another name is still one
        return path
    for candidate in (path / "checkpoints", path):
        newest = newest_complete(candidate)
        if newest is not None:
            return newest
    damaged = _newest_step_dir(path)
    if damaged is not None:
        raise CheckpointError(f"{field} holds no complete checkpoint: its newest, "
                              f"{damaged.name}, {_incomplete(damaged)}; give an older step_* "
                              f"directory or a run directory that saved one")
    raise CheckpointError(f"{field} holds no complete checkpoint (no step_* directory with "
                          f"{MANIFEST}); give a checkpoint directory or a run directory that "
                          f"saved one")


def _incomplete(path: Path) -> str:
    """Why ``step_*`` directory ``path`` is no complete checkpoint, naming the missing file:
    the manifest (written last, so an interrupted save or a copy cut short) or DCP's
    ``.metadata`` beside a manifest (a damaged one)."""
    if not (path / MANIFEST).is_file():
        return f"is not a complete checkpoint (an interrupted save has no {MANIFEST})"
    return (f"is damaged: it lacks DCP's {DCP_METADATA}, the index of its tensors (its "
            f"{MANIFEST} is there)")


def _newest_step_dir(path: Path) -> Optional[Path]:
    """The newest ``step_*`` directory in ``path/checkpoints`` or ``path``, complete or not."""
    for candidate in (path / "checkpoints", path):
        steps = sorted(entry for entry in candidate.glob("step_*")
                       if _NAME.match(entry.name) and entry.is_dir())
        if steps:
            return steps[-1]
    return None


def check_files(path: Path, manifest: dict) -> None:
    """Every data file the manifest lists exists with its recorded size (truncation)."""
    for name, info in sorted(manifest["files"].items()):
        file = Path(path) / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} lacks its file {name}; it is damaged: "
                                  f"resume from an older one")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {file} has {size} bytes, the save wrote "
                                  f"{info['bytes']}: it is truncated or damaged; resume from "
                                  f"an older checkpoint")


def check_model_matches(manifest: dict, model_cfg, path: Path, padding: bool = True) -> None:
    """The checkpoint's model shape equals the config's, field by field (``padding``: the
    padded vocabulary too; weights alone load into any padding)."""
    saved = check_shape(manifest, model_cfg, path, padding, CheckpointError)
    _check_context(saved["seq_len"], model_cfg, path, sliced=not padding)
    _check_expert_bias(manifest, model_cfg, path)


def _check_context(saved: int, model_cfg, path: Path, sliced: bool) -> None:
    """``model.seq_len`` against the checkpoint's: any for a family without learned positions;
    for learned ones (GPT-2) equal, or fewer where the weights are sliced on load
    (``checkpoint.init_from``, as HF slices ``wpe``)."""
    wanted = model_cfg.seq_len
    if saved == wanted or not model_spec(model_cfg).learned_positions:
        return
    if sliced and wanted < saved:
        return
    fix = (f"set model.seq_len <= {saved}" if sliced else
           f"set model.seq_len={saved}, or start a new run from it with "
           f"checkpoint.init_from={path} and model.seq_len <= {saved}")
    raise CheckpointError(
        f"model.seq_len={wanted}: the checkpoint {path.name} has learned positions for "
        f"{saved} tokens ({model_cfg.family} has no weights past them); {fix}")


def _check_expert_bias(manifest: dict, model_cfg, path: Path) -> None:
    """A checkpoint whose MoE layers carry the aux-loss-free expert bias routes by it: a
    model without the bias (rate 0) would drop it and route otherwise, so it is refused."""
    biased = [name for name in manifest.get("tensors", {}) if is_expert_bias(name)]
    moe = model_cfg.moe
    if biased and not (moe.experts and moe.expert_bias_rate > 0):
        saved_model = nest_model((manifest.get("config") or {}).get("model") or {})
        saved = (saved_model.get("moe") or {}).get("expert_bias_rate")
        raise CheckpointError(
            f"the checkpoint {path.name} routes with an expert bias in each MoE layer "
            f"(model.moe.expert_bias_rate={saved} when saved), which a model with "
            f"model.moe.expert_bias_rate={moe.expert_bias_rate} has no place for; "
            f"set model.moe.expert_bias_rate > 0 (e.g. {saved}) to keep it")


def prune(directory: Path, keep: int) -> list[Path]:
    """Remove interrupted saves and all but the newest ``keep`` complete checkpoints (``keep``
    0: keep all). Returns what was removed."""
    directory = Path(directory)
    removed = []
    for entry in directory.glob("step_*.tmp"):
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    complete = complete_checkpoints(directory)
    if keep > 0:
        for _, path in complete[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
