"""``data.source=indexed`` through megatron-core's ``GPTDataset`` and ``BlendedDataset``.

megatron-core builds, per data set and split, a document index, a sample index (samples of
``seq_len + 1`` tokens packed across documents, each ending where the next begins) and a
shuffle index, and for a blend the interleaving that keeps every prefix of the run within a
sample of the weights. Those indices are cached as ``.npy`` files named by a hash of what
they depend on. hybrid decides where and when they are built:

- where: ``data.cache_dir``, else ``<run dir>/data_cache``; never beside the data (megatron's
  default when no cache folder is given);
- when: once, by ``hybrid-train`` before any rank starts (``build_caches``), into a private
  staging folder whose files are then renamed into the cache, so that two launchers (two
  torchrun nodes on one shared folder) never see each other's half-written files; a warm
  cache is reused as it is. The ranks only map the files (``defer_npy_index_mmap``: megatron
  never builds there) and open the data sets before ``torch.distributed`` is initialised, so
  megatron's builder calls none of its rank-0-first barriers.

Megatron's blend cache is built with a 1-rank gloo group on a ``HashStore`` (no socket):
megatron-core 0.16 asks ``torch.distributed.get_rank()`` unguarded when a blend's cache is
cold (``blended_dataset.py``), which fails without a process group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from hybrid.data.dataset import DataError
from hybrid.megatron_import import import_megatron
from hybrid.planning.data_sources import SPLITS

CACHE_FILES = ("document_index.npy", "sample_index.npy", "shuffle_index.npy",
               "dataset_index.npy", "dataset_sample_index.npy")


@dataclass(frozen=True)
class IndexedSpec:
    """Everything megatron-core's indices depend on (what the ranks and the launcher share)."""

    prefixes: tuple[str, ...]
    """Absolute: megatron hashes the path as given."""
    weights: Optional[tuple[float, ...]]
    split: tuple[float, float, float]
    seq_len: int
    seed: int
    sizes: tuple[int, int, int]
    """Samples each split must hold at least (train: train.steps x train.global_batch)."""
    cache_dir: str
    vocab_size: Optional[int] = None
    eod: Optional[int] = None
    built: tuple[bool, bool, bool] = (True, True, True)
    """The parts of the split the run reads; megatron builds (and may open) only these, so a
    part that nothing reads may be empty (megatron loops forever on an empty part)."""


class _DatasetTokenizer:
    """What megatron's dataset config reads of a tokenizer (it never tokenizes here)."""

    def __init__(self, spec: IndexedSpec):
        # -1 is megatron's "no pad token": an eod of -1 would collide with it (a warning)
        self.vocab_size, self.eod = spec.vocab_size, spec.eod if spec.eod is not None else -2
        self.unique_identifiers = {"class": "hybrid", "vocab_size": spec.vocab_size,
                                   "eod": spec.eod}


def _config(spec: IndexedSpec, cache_dir: str, defer: bool):
    GPTDatasetConfig = import_megatron("megatron.core.datasets.gpt_dataset").GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=spec.seed, sequence_length=spec.seq_len,
        blend=(list(spec.prefixes), None if spec.weights is None else list(spec.weights)),
        split=",".join(format(part, "f") for part in spec.split),
        path_to_cache=cache_dir, tokenizer=_DatasetTokenizer(spec),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,  # hybrid's attention is causal by itself
        defer_npy_index_mmap=defer)
    # A part left out is None in megatron's split matrix, as a part of weight 0 is; the others
    # keep their bookends, so every document stays in the part the split gives it.
    config.split_matrix = [bounds if built else None
                           for bounds, built in zip(config.split_matrix, spec.built)]
    return config


def _build(spec: IndexedSpec, cache_dir: str, defer: bool) -> list:
    """[train, valid, test] (None for a split of size 0)."""
    with _quiet_megatron():
        import_megatron()
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder)
        from megatron.core.datasets.gpt_dataset import GPTDataset

        return BlendedMegatronDatasetBuilder(GPTDataset, list(spec.sizes), lambda: True,
                                             _config(spec, cache_dir, defer)).build()


def cache_files(datasets: list) -> list[str]:
    """Every index file the (deferred) data sets read."""
    files = []
    for dataset in datasets:
        if dataset is None:
            continue
        for part in [dataset, *getattr(dataset, "datasets", [])]:
            files += [getattr(part, f"path_to_{name[:-4]}") for name in CACHE_FILES
                      if hasattr(part, f"path_to_{name[:-4]}")]
    return files


def build_caches(spec: IndexedSpec) -> bool:
    """Build megatron's indices into ``spec.cache_dir`` unless they are there; True if built."""
    os.makedirs(spec.cache_dir, exist_ok=True)
    if all(os.path.isfile(path) for path in cache_files(_build(spec, spec.cache_dir, True))):
        return False
    staging = tempfile.mkdtemp(prefix=".building-", dir=spec.cache_dir)
    try:
        with _single_rank_group():
            _build(spec, staging, defer=False)
        names = sorted(os.listdir(staging), key=lambda n: n.endswith("description.txt"))
        for name in names:  # descriptions last: megatron counts a cache hit by them
            os.replace(os.path.join(staging, name), os.path.join(spec.cache_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def open_split(spec: IndexedSpec, split: str = "train") -> "IndexedSamples":
    """A split whose indices ``build_caches`` made; never builds (call before
    ``torch.distributed`` is initialised: megatron's builder then needs no barrier)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("open indexed data before torch.distributed.init_process_group: "
                           "megatron-core's builder would run barriers on the world group")
    datasets = _build(spec, spec.cache_dir, defer=True)
    missing = [path for path in cache_files(datasets) if not os.path.isfile(path)]
    if missing:
        raise DataError(f"{missing[0]} is missing: the data's sample indices are built by "
                        f"hybrid-train before the ranks start; start the run with hybrid-train "
                        f"(or hybrid-plan out=DIR) again")
    dataset = datasets[SPLITS.index(split)]
    if dataset is None:
        raise DataError(f"data.split has no {split} part; give it one, e.g. "
                        f"data.split=[969,30,1]")
    return IndexedSamples(dataset, spec.seq_len)


class IndexedSamples:
    """Sample ``i`` of a megatron data set as int64 ``[seq_len + 1]``; ``ordered``: the data
    set is already shuffled (by ``seed``) and sized for the run, so the loader reads it in
    order."""

    ordered = True

    def __init__(self, dataset, seq_len: int):
        self.dataset, self.seq_len = dataset, seq_len

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        sample = self.dataset[index]
        tokens, labels = sample["tokens"].numpy(), sample["labels"].numpy()
        return np.concatenate([tokens, labels[-1:]]).astype(np.int64, copy=False)

    def source_of(self, index: int) -> int:
        """Which data set of the blend sample ``index`` comes from (0 for one data set)."""
        dataset_index = getattr(self.dataset, "dataset_index", None)
        if dataset_index is None and hasattr(self.dataset, "path_to_dataset_index"):
            dataset_index = np.load(self.dataset.path_to_dataset_index, mmap_mode="r")
        return 0 if dataset_index is None else int(dataset_index[index])


@contextlib.contextmanager
def _single_rank_group() -> Iterator[None]:
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _quiet_megatron() -> Iterator[None]:
    """megatron-core warns on import that Transformer Engine and Apex are absent (expected on
    CPU), and its dataset builders log every index they build or load at INFO."""
    import logging
    import warnings

    logger = logging.getLogger("megatron")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
            yield
    finally:
        logger.setLevel(level)
