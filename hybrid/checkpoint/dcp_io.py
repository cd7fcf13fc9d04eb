"""Reading and writing checkpoints with ``torch.distributed.checkpoint`` (DCP).

The DCP state dict is flat and keyed by global names (``hybrid.planning.params``), so any layout loads
any checkpoint; DCP reshards by itself:

- ``model.<name>``: a TP-split parameter is a ``DTensor`` sharded on its ``tp_dim`` over the
  TP group's mesh (its local tensor *is* the parameter, so a load writes into the model in
  place); a replicated one is a plain tensor. DP replicas and the tied copy on the last stage
  save the same key and DCP keeps one copy.
- ``optim.<name>.{exp_avg,exp_avg_sq}`` the same way, ``optim.<name>.step`` plain (see
  ``hybrid.dp.state``: the same tensors whatever the ZeRO stage and buckets).
- ``train.step`` and ``rng.cpu`` (the CPU generator's state; training draws no random numbers
  today, restoring it keeps any later consumer on its stream).

DCP's ``.metadata`` is a pickle: ``SafeReader`` unpickles only DCP's own metadata classes, and
tensors are read with ``weights_only=True`` by DCP itself, so loading runs no foreign code.
"""

from __future__ import annotations

import io
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hybrid.checkpoint.store import CheckpointError

_CLASS_MODULES = ("torch.distributed.checkpoint.", "collections")
"""Modules whose *classes* (never functions) DCP's metadata is made of."""
_ALLOWED_NAMES = {
    "torch": {"Size", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16",
              "int8", "uint8", "bool", "strided", "contiguous_format", "preserve_format",
              "channels_last"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "builtins": {"set", "frozenset"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_NAMES.get(module, ()):
            return super().find_class(module, name)
        if module.startswith(_CLASS_MODULES):
            found = super().find_class(module, name)
            if isinstance(found, type):  # a function of DCP could act (write, delete) if called
                return found
        raise CheckpointError(f"checkpoint metadata asks to load {module}.{name}, which a DCP "
                              f"checkpoint never contains; refusing to unpickle it")


class SafeReader(FileSystemReader):
    """DCP's file reader with a metadata unpickler limited to DCP's own classes.

    ``read_metadata`` is ``FileSystemReader.read_metadata`` (torch 2.13) with the unpickler
    replaced; every load in ``tests/test_checkpoint_e2e.py`` goes through it, and
    ``tests/test_checkpoint_store.py`` shows it refusing a foreign pickle.
    """

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def os_error_in(err: BaseException) -> OSError | None:
    """The ``OSError`` behind a DCP ``CheckpointException`` (which carries one per failed
    rank), if any: a full disk, a vanished directory."""
    failures = getattr(err, "failures", None) or {}
    for exc, _trace in failures.values():
        if isinstance(exc, OSError):
            return exc
    return err if isinstance(err, OSError) else None


def read_metadata(path: Path):
    """DCP's metadata of a checkpoint directory (no process group needed)."""
    with open(Path(path) / ".metadata", "rb") as handle:
        return _MetadataUnpickler(io.BytesIO(handle.read())).load()


@dataclass(frozen=True)
class Meshes:
    """The device meshes a rank's shards are placed on: the TP group's, and for an expert's
    weights (split over the expert-parallel group on ``ep_dim`` and over TP) the ``ep x tp``
    one, so a checkpoint holds every expert by its global index whatever ``ep`` saved it."""

    tp: DeviceMesh
    expert: Optional[DeviceMesh] = None
    """None at ``ep=1`` (experts are split over TP only)."""


def tp_mesh(groups) -> Meshes:
    """The meshes of ``groups`` (``Meshes``)."""
    device = groups.device.type
    tp = DeviceMesh.from_group(groups.tensor.pg, device_type=device)
    layout = groups.layout
    if layout.ep == 1:
        return Meshes(tp)
    if layout.tp == 1:
        return Meshes(tp, DeviceMesh.from_group(groups.expert.pg, device_type=device))
    ranks = [groups.replica_offset + r
             for r in layout.group_of("tp-ep", groups.local_rank_in_layout)]  # tp fastest
    grid = torch.tensor(ranks).view(layout.ep, layout.tp)
    return Meshes(tp, DeviceMesh.from_group([groups.expert.pg, groups.tensor.pg], device,
                                            mesh=grid, mesh_dim_names=("ep", "tp")))


def as_global(tensor: torch.Tensor, spec, mesh: Meshes) -> torch.Tensor:
    """``tensor`` (this rank's shard of ``spec``) as DCP should see it: a DTensor placed on
    the TP mesh when split over TP, on the ``ep x tp`` mesh when an expert's split over ep;
    the plain tensor when replicated."""
    if spec.ep_dim is not None and mesh.expert is not None:
        placements = [Shard(spec.ep_dim)]
        if mesh.expert.ndim == 2:
            placements.append(Shard(spec.tp_dim) if spec.tp_dim is not None else Replicate())
        return DTensor.from_local(tensor, mesh.expert, placements, run_check=False,
                                  shape=torch.Size(spec.shape),
                                  stride=_contiguous_stride(spec.shape))
    if spec.tp_dim is None or mesh.tp.size() == 1:
        return tensor
    return DTensor.from_local(tensor, mesh.tp, [Shard(spec.tp_dim)], run_check=False,
                              shape=torch.Size(spec.shape),
                              stride=_contiguous_stride(spec.shape))


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


class HostCopyStager:
    """Stages a state dict for DCP's ``async_save``: every tensor copied into a fresh host
    tensor of its own (DCP's default stager deep-copies a DTensor's whole storage, which
    fails for a DTensor over a view into a larger buffer, as ZeRO-1's flat parameters are).
    The copy is the host memory an async save holds until its write ends."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict) -> dict:
        return {key: _host_copy(value) for key, value in state_dict.items()}

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _host_copy(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        local = value.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return value.detach().to("cpu", copy=True)


def file_checksums(directory: Path, rank: int) -> dict[str, dict]:
    """Size and CRC-32 of the DCP data files this rank wrote (``__{rank}_*.distcp``), and on
    rank 0 of DCP's ``.metadata`` (which it writes last): every file a load reads."""
    files = sorted(Path(directory).glob(f"__{rank}_*.distcp"))
    if rank == 0 and (Path(directory) / ".metadata").is_file():
        files.append(Path(directory) / ".metadata")
    return {file.name: {"bytes": file.stat().st_size, "crc32": crc32_of(file)}
            for file in files}


def crc32_of(file: Path) -> int:
    crc = 0
    with open(file, "rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def first_corrupt_file(path: Path, manifest: dict, names: list[str]) -> Optional[str]:
    """The first of ``names`` whose CRC-32 differs from the manifest's, or None."""
    return next((name for name in names
                 if crc32_of(Path(path) / name) != manifest["files"][name]["crc32"]), None)


def corrupt_file_error(path: Path, name: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {Path(path) / name} does not match the checksum "
                           f"written with it: it is corrupted; resume from an older checkpoint")


def verify_files_here(path: Path, manifest: dict) -> None:
    """Every file's CRC-32 against the manifest, in this one process (``hybrid-ckpt``)."""
    bad = first_corrupt_file(path, manifest, sorted(manifest["files"]))
    if bad is not None:
        raise corrupt_file_error(path, bad)


def verify_files(path: Path, manifest: dict, world) -> None:
    """Each rank of the ``world`` group checks every ``world.size()``-th data file's CRC-32
    against the manifest; if any differs, every rank raises ``CheckpointError`` naming the
    first bad file."""
    names = sorted(manifest["files"])
    bad = first_corrupt_file(path, manifest, names[world.rank()::world.size()])
    flags = torch.tensor([names.index(bad) if bad else len(names)], dtype=torch.int64)
    world.all_reduce(flags, op=dist.ReduceOp.MIN)
    first = int(flags.item())
    if first < len(names):
        raise corrupt_file_error(path, names[first])
