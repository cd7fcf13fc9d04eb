"""How a checkpoint that every rank has written becomes visible: its manifest (the last file
written), the rename of ``step_XXXXXXXX.tmp`` to its final name, and the one line a failed
write ends in.

Apart from ``checkpointer.py`` because this is the save's last, rank-0 act on the files,
the same for a blocking and a background save; the checkpointer decides when it happens.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch
from torch.distributed.checkpoint.api import CheckpointException

from hybrid.checkpoint.dcp_io import os_error_in, read_metadata
from hybrid.checkpoint.store import FORMAT_VERSION, model_shape
from hybrid.files import RunDirError
from hybrid.planning.config import to_dict
from hybrid.planning.layout import COORD_ORDER


def build_manifest(step: int, partial: Path, files: list[dict], *, plan, layout, world: int,
                   data: dict) -> dict:
    """The manifest of the checkpoint written into ``partial``: its tensors (from DCP's
    metadata), layout, model, config, data and every rank's ``files`` with their checksums."""
    metadata = read_metadata(partial)
    tensors = {}
    for key, item in sorted(metadata.state_dict_metadata.items()):
        dtype = item.properties.dtype
        shape = list(item.size)
        tensors[key] = {"shape": shape, "dtype": str(dtype).removeprefix("torch."),
                        "bytes": int(torch.Size(shape).numel()) * dtype.itemsize}
    cfg = plan.cfg
    return {"format": FORMAT_VERSION, "step": step,
            "consumed_samples": step * cfg.train.global_batch,
            "layout": {**{axis: layout.size(axis) for axis in COORD_ORDER},
                       "vpp": layout.vpp, "zero": cfg.parallel.zero,
                       "schedule": cfg.parallel.schedule, "world": world},
            "model": model_shape(cfg.model), "config": to_dict(cfg), "tensors": tensors,
            "stages": [[stage.blocks.start, stage.blocks.stop] for stage in plan.stages],
            "tokenizer": plan.tokenizer, "data": data,
            "files": {name: info for per_rank in files for name, info in per_rank.items()}}


@contextlib.contextmanager
def write_errors_named(path: Path) -> Iterator[None]:
    """A save DCP could not write ends in one line naming the checkpoint and the free space.

    A full disk shows up as an ``OSError`` or, inside ``torch.save``'s zip writer, as a
    ``RuntimeError`` ("unexpected pos"); DCP wraps either in a ``CheckpointException``, which
    is a ``BaseException`` and would escape the worker's error reporting."""
    try:
        yield
    except CheckpointException as err:
        cause = os_error_in(err) or next(iter(err.failures.values()))[0]
        free = shutil.disk_usage(path.parent).free
        raise RunDirError(f"cannot write checkpoint {path}: {type(cause).__name__}: "
                          f"{str(cause).strip().splitlines()[-1]} ({free} bytes free there); "
                          f"free space or choose another checkpoint.dir") from None


def replace_dir(partial: Path, final: Path) -> None:
    """Rename ``partial`` to ``final``; an older ``final`` (a run resumed from an earlier
    step saves the same step again) is moved aside first and removed after."""
    aside = None
    if final.exists():
        aside = final.with_name(final.name + ".old")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(partial, final)
    fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

