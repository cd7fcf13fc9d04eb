"""Sharded safetensors, as the hub ships a model above a few GB: ``model.safetensors.index.json``
(``weight_map``: tensor name -> file) beside ``model-0000k-of-0000n.safetensors``.

Reading checks the whole set before any tensor is read (every named file present, every file's
header readable and whole, every tensor of the index in the file it names), then yields the
tensors one at a time through ``safetensors.safe_open``, so a reader holds one tensor beyond
what it keeps. Writing cuts a model into files of at most ``max_shard_size`` bytes in the order
given, with HF's names and index, which ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from hybrid.interop.errors import ConversionError

if TYPE_CHECKING:
    import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a byte count -> bytes (HF's units: GB is 10^9)."""
    found = _SIZE.match(str(text))
    if found is None or float(found[1]) <= 0:
        raise ConversionError(f"--max-shard-size={text!r} is no size; give bytes or a number "
                              f"with a unit, e.g. 5GB, 500MB, 2GiB")
    return int(float(found[1]) * _UNITS[(found[2] or "B").upper()])


def index_of(folder: Path) -> dict[str, str] | None:
    """The ``weight_map`` of ``folder``'s index (None: no index), after checking the files it
    names: present, readable, whole, and holding the tensors it says they hold."""
    file = folder / INDEX
    if not file.is_file():
        return None
    try:
        weight_map = json.loads(file.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise ConversionError(f"{file} is no safetensors index (no weight_map: {err}); copy "
                              f"the model again") from None
    for shard in sorted(set(weight_map.values())):
        names = {name for name, where in weight_map.items() if where == shard}
        _check_shard(folder / shard, names, file)
    return weight_map


def _check_shard(path: Path, names: set[str], index: Path) -> None:
    """``path`` exists, its header opens, its data is as long as the header says, and it holds
    every tensor of ``names``."""
    if not path.is_file():
        raise ConversionError(f"{path.name}, named by {index.name}, is missing from "
                              f"{path.parent}; copy the model again with all its shards")
    held, data_end = _header(path)
    if path.stat().st_size < data_end:
        raise ConversionError(f"{path} is truncated ({path.stat().st_size} bytes, its header "
                              f"says {data_end}); copy the model again")
    lost = sorted(names - held)
    if lost:
        raise ConversionError(f"{index.name} puts {lost[0]} in {path.name}, which does not hold "
                              f"it ({len(lost)} such); the index and shards are from different "
                              f"models: copy the model again")


def _header(path: Path) -> tuple[set[str], int]:
    """(tensor names, the byte where the data ends) from a safetensors file's header alone."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        try:
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = json.loads(handle.read(length)) if 0 < length < 10**9 else None
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise ConversionError(f"{path} has no readable safetensors header: it is damaged or "
                              f"not safetensors; copy the model again")
    ends = [info["data_offsets"][1] for name, info in header.items() if name != "__metadata__"]
    return set(header) - {"__metadata__"}, 8 + length + max(ends, default=0)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checked folder: its index's shards, or ``model.safetensors``."""
    weight_map = index_of(folder)
    if weight_map is None:
        return [folder / SINGLE]
    return [folder / shard for shard in sorted(set(weight_map.values()))]


def iter_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (HF name, tensor) of ``folder``'s safetensors, one tensor read at a time."""
    from safetensors import SafetensorError, safe_open

    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except SafetensorError as err:
            raise ConversionError(f"{path} cannot be read ({err}): it is damaged or not "
                                  f"safetensors; copy the model again") from None


def shard_plan(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names grouped in order into files of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_names(count: int) -> list[str]:
    """HF's file names for ``count`` shards (one: ``model.safetensors``)."""
    if count == 1:
        return [SINGLE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def save_sharded(tensors: dict[str, torch.Tensor], folder: Path, max_bytes: int) -> None:
    """Write ``tensors`` into ``folder`` as HF's shards and index (one file if they fit)."""
    from safetensors.torch import save_file

    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    groups = shard_plan(sizes, max_bytes)
    names = shard_names(len(groups))
    for file, group in zip(names, groups):
        save_file({n: tensors[n] for n in group}, str(folder / file), metadata={"format": "pt"})
        # safetensors creates its file 0600; give it a new file's mode, as the others get
        os.chmod(folder / file, folder.stat().st_mode & 0o666)
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: file for file, group in zip(names, groups) for n in group}}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
