"""The data set a config names, and its checks before any worker starts.

Three sources (``data.source``): ``synthetic`` (``hybrid.data.synthetic``), ``tokens``
(``hybrid.data.token_file``) and ``indexed`` (``hybrid.data.megatron``). ``validate_data``
runs in the launcher and reads only headers, records and (for files without a record) the
tokens; ``open_dataset`` runs on every rank.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from hybrid.data.dataset import DataError, TokenDataset
from hybrid.data.indexed import document_tokens, read_index
from hybrid.data.metadata import check_same_tokenizer, check_vocab, recorded_tokenizer
from hybrid.data.megatron import IndexedSpec, open_split
from hybrid.data.synthetic import HeldOutMarkov, MarkovDataset
from hybrid.data.token_file import TokenFileDataset, check_token_file, max_token
from hybrid.planning.data_sources import (SPLIT_NAMES, SPLITS, blend_of, data_problem,
                                          evaluates, read_parts, show_list, split_documents,
                                          split_fractions, working_split)

DATA_CACHE = "data_cache"
"""The run directory's folder for megatron's index caches when ``data.cache_dir`` is unset."""


def make_dataset(data_cfg: Any, model_cfg: Any, seed: int) -> TokenDataset:
    """The synthetic or token-file data set ``data_cfg`` describes (cheap checks only: no scan
    of a token file; windows are checked as they are read)."""
    if data_cfg.source == "synthetic":
        if data_cfg.samples < 1:
            raise DataError(f"data.samples={data_cfg.samples} must be >= 1 for "
                            f"data.source=synthetic; raise data.samples")
        return MarkovDataset(vocab=model_cfg.vocab, seq_len=model_cfg.seq_len,
                             samples=data_cfg.samples, seed=seed)
    if data_cfg.source == "tokens":
        return TokenFileDataset(path=data_cfg.path, dtype=data_cfg.dtype,
                                vocab=model_cfg.vocab, seq_len=model_cfg.seq_len)
    raise DataError(data_problem(data_cfg) or "data.source=indexed is opened from the job's "
                    "plan: hybrid.data.open_dataset(plan)")


def open_dataset(plan: Any, split: str = "train") -> TokenDataset:
    """The data set a rank trains on (``split``: an indexed source's train, valid or test)."""
    cfg = plan.cfg
    if cfg.data.source == "indexed":
        return open_split(indexed_spec(plan), split)
    return make_dataset(cfg.data, cfg.model, cfg.seed)


def open_eval_dataset(plan: Any) -> Optional[TokenDataset]:
    """The validation data a rank evaluates on (None when the run does not evaluate): the
    indexed source's validation split, or the synthetic chain's held-out walks; read in
    order, ``eval.batches`` global batches of it, the same ones at every evaluation."""
    cfg = plan.cfg
    if not evaluates(cfg.eval, cfg.data):
        return None
    if cfg.data.source == "indexed":
        return open_split(indexed_spec(plan), "valid")
    train = make_dataset(cfg.data, cfg.model, cfg.seed)
    return HeldOutMarkov(train, eval_samples(cfg))


def eval_samples(cfg: Any) -> int:
    """Samples one evaluation reads."""
    return cfg.eval.batches * cfg.train.global_batch


def indexed_spec(plan: Any) -> IndexedSpec:
    """What megatron's indices of ``plan``'s indexed source depend on: the train split sized
    for the run, the validation split for one evaluation, the test split for one batch."""
    cfg = plan.cfg
    blend = blend_of(cfg.data)
    built = read_parts(cfg.eval, cfg.data)
    sizes = (cfg.train.steps * cfg.train.global_batch, eval_samples(cfg), 0)
    return IndexedSpec(prefixes=plan.data_prefixes, weights=blend.weights,
                       split=split_fractions(cfg.data.split), seq_len=cfg.model.seq_len,
                       seed=cfg.seed, sizes=tuple(n if b else 0 for n, b in zip(sizes, built)),
                       cache_dir=plan.data_cache_dir, vocab_size=cfg.model.vocab, built=built)


def resolve_prefixes(data_cfg: Any) -> tuple[str, ...]:
    """An indexed source's prefixes as absolute paths (megatron hashes the path it is given,
    so a relative one would name another cache from another folder)."""
    if data_cfg.source != "indexed":
        return ()
    return tuple(os.path.abspath(os.path.expanduser(p)) for p in blend_of(data_cfg).prefixes)


def validate_data(data_cfg: Any, model_cfg: Any, train_cfg: Any,
                  eval_cfg: Any = None) -> Optional[int]:
    """Check the data before any worker starts; the number of samples of a synthetic or token
    file source (None for an indexed one, whose samples megatron counts when it builds).

    Raises ``DataError`` with one line for a missing or mis-sized file, a file shorter than
    one global batch, token ids >= ``model.vocab``, a recorded vocabulary larger than
    ``model.vocab``, a blend of differently tokenized data sets, or a split that leaves a part
    the run reads (``read_parts(eval_cfg)``) without a document.
    """
    if data_cfg.source == "indexed" and data_cfg.example is not None:
        if model_cfg.vocab < 256:  # the built-in corpora are byte-level
            raise DataError(f"data.example={data_cfg.example} is byte-level (ids 0..255) but "
                            f"model.vocab={model_cfg.vocab}; set model.vocab=256 or more")
        return None
    if data_cfg.source == "indexed":
        _check_indexed(data_cfg, model_cfg, read_parts(eval_cfg, data_cfg))
        return None
    dataset = make_dataset(data_cfg, model_cfg, seed=0)
    if len(dataset) < train_cfg.global_batch:
        raise _too_few_samples_error(data_cfg, model_cfg, len(dataset), train_cfg.global_batch)
    if isinstance(dataset, TokenFileDataset):
        check_vocab(data_cfg.path, "data.path", model_cfg.vocab)
        check_token_file(data_cfg.path, data_cfg.dtype, model_cfg.vocab)
    return len(dataset)


def _check_indexed(data_cfg: Any, model_cfg: Any, read: tuple[bool, bool, bool]) -> None:
    field = "data.path" if data_cfg.blend is None else "data.blend"
    infos, records = {}, {}
    for prefix in blend_of(data_cfg).prefixes:
        infos[prefix] = info = read_index(prefix)
        _check_dtype_holds(prefix, info, recorded_tokenizer(prefix))
        records[prefix] = check_vocab(prefix, field, model_cfg.vocab)
        if records[prefix] is None:  # Megatron's own files record no tokenizer: scan them
            largest = max_token(document_tokens(prefix, info))
            if largest >= model_cfg.vocab:
                raise DataError(f"{field}: {prefix}.bin holds token id {largest} >= "
                                f"model.vocab={model_cfg.vocab}; set model.vocab={largest + 1} "
                                f"or more (the tokenizer's vocabulary size)")
    check_same_tokenizer(records)
    _check_split(data_cfg.split, {prefix: info.documents for prefix, info in infos.items()},
                 read)


def _check_dtype_holds(prefix: str, info: Any, recorded: Any) -> None:
    """A recorded vocabulary the file's dtype cannot hold: ids were cut when it was written."""
    if recorded is not None and recorded.vocab_size - 1 > np.iinfo(info.dtype).max:
        raise DataError(f"{prefix}.bin stores {info.dtype} tokens but was tokenized with "
                        f"{recorded.source} (vocabulary {recorded.vocab_size}): larger ids "
                        f"cannot have survived; remake it with hybrid-data (it picks a dtype "
                        f"that holds the vocabulary)")


def _check_split(split: Any, documents: dict[str, int], read: tuple[bool, bool, bool]) -> None:
    """Every part the run reads gets a document of every data set (megatron would loop
    forever on an empty one); the parts nothing reads are not built and may be empty."""
    for prefix, count in documents.items():
        parts = split_documents(split, count)
        empty = [name for name, wanted, part in zip(SPLITS, read, parts) if wanted and not part]
        if not empty:
            continue
        name = SPLIT_NAMES[empty[0]]
        counts = ", ".join(f"{SPLIT_NAMES[n]} {part}" for n, part in zip(SPLITS, parts))
        better = working_split(list(documents.values()), read)
        fix = f"use data.split={show_list(list(better))}" if better else \
            "use more documents (a train and a validation part need 2 or more)"
        if empty[0] == "valid":
            fix += ", or evaluate nothing (eval.every=0 eval.at_end=false)"
        documents_split = "1 document splits" if count == 1 else f"{count} documents split"
        raise DataError(f"data.split={show_list(list(split))} leaves the {name} part of "
                        f"{prefix} empty: its {documents_split} {counts}; {fix}")


def _too_few_samples_error(data_cfg: Any, model_cfg: Any, samples: int,
                           global_batch: int) -> DataError:
    if data_cfg.source == "synthetic":
        return DataError(f"data.samples={samples} is fewer than train.global_batch="
                         f"{global_batch}; raise data.samples or lower train.global_batch")
    return DataError(f"data.path={data_cfg.path} holds {samples} samples of "
                     f"model.seq_len+1={model_cfg.seq_len + 1} tokens (stride "
                     f"{model_cfg.seq_len}), fewer than train.global_batch={global_batch}; "
                     f"use a longer file or lower train.global_batch")

