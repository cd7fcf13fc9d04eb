"""What a run's data was, for a checkpoint to record and a resume to compare (pure: no torch).

A checkpoint continues a run at a data position: sample ``step * global_batch`` of an order
drawn from ``seed``. Resumed on other data (a token file changed, truncated or swapped) or
with another seed or global batch, the position means something else and the run goes on in
silence on data it never meant to read. Each data file is fingerprinted by its size and a
SHA-256 of its first and last MiB (cheap for any size, and any truncation, append or swap
changes it); generated data has no file and is fully described by the config.

What is compared is what the data *is*, never where it lies: the same bytes in another folder
(a run directory of their own, a moved or copied data set, the built-in corpus rebuilt in
another cache) are the same data. A path is named only to say which file differs.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

EDGE_BYTES = 1 << 20


def data_files(cfg, data_prefixes: tuple[str, ...] = ()) -> list[str]:
    """The files a run reads: a token file, or each indexed prefix's ``.bin`` and ``.idx``
    (``data_prefixes``: the plan's, resolved before launch)."""
    if cfg.data.source == "tokens" and cfg.data.path:
        return [os.path.abspath(os.path.expanduser(cfg.data.path))]
    return [prefix + suffix for prefix in data_prefixes for suffix in (".bin", ".idx")]


def fingerprint(files: list[str]) -> list[dict]:
    """``[{"file", "bytes", "edges_sha256"}]`` of each file, in order."""
    out = []
    for name in files:
        size = os.path.getsize(name)
        digest = hashlib.sha256()
        with open(name, "rb") as handle:
            digest.update(handle.read(EDGE_BYTES))
            if size > EDGE_BYTES:
                handle.seek(max(EDGE_BYTES, size - EDGE_BYTES))
                digest.update(handle.read())
        out.append({"file": name, "bytes": size, "edges_sha256": digest.hexdigest()})
    return out


def run_data_record(cfg, data_prefixes: tuple[str, ...] = (),
                    tokenizer: Optional[dict] = None) -> dict:
    """What a checkpoint records of its run's data: its files' fingerprints, the tokenizer
    that made them, and the settings that decide which samples come in which order."""
    record = {"seed": cfg.seed, "global_batch": cfg.train.global_batch,
              "files": fingerprint(data_files(cfg, data_prefixes)), "tokenizer": tokenizer}
    if cfg.data.source == "indexed":
        record["split"] = [float(part) for part in cfg.data.split]
        record["blend_weights"] = _blend_weights(cfg.data)
    return record


def _blend_weights(data_cfg) -> Optional[list[float]]:
    """A blend's weights, normalised (None for one data set)."""
    if not data_cfg.blend:
        return None
    weights = [float(w) for w in data_cfg.blend[0::2]]
    total = sum(weights)
    return [w / total for w in weights]


def changed_file(saved: list[dict], now: list[dict]) -> Optional[str]:
    """How the run's data files differ from a checkpoint's in content, as a phrase, or None
    (the same bytes at another path are the same data)."""
    if len(saved) != len(now):
        before = ", ".join(f["file"] for f in saved) or "generated data"
        after = ", ".join(f["file"] for f in now) or "generated data"
        return f"it trained on {before}, this run reads {after}"
    for old, new in zip(saved, now):
        moved = "" if old["file"] == new["file"] else f" (the checkpoint's {old['file']})"
        if old["bytes"] != new["bytes"]:
            return (f"{new['file']}{moved} had {old['bytes']:,} bytes then and has "
                    f"{new['bytes']:,} now")
        if old["edges_sha256"] != new["edges_sha256"]:
            return f"{new['file']}{moved} has the same size but other contents than then"
    return None


def changed_tokenizer(saved: dict, tokenizer: Optional[dict]) -> Optional[str]:
    """How the data's tokenizer differs from the checkpoint's, as a phrase, or None (also when
    the checkpoint predates the record)."""
    if "tokenizer" not in saved or _identity(saved["tokenizer"]) == _identity(tokenizer):
        return None
    return f"it was tokenized with {_tokenizer_name(saved['tokenizer'])}, this run's data " \
           f"with {_tokenizer_name(tokenizer)}"


def _identity(info: Optional[dict]) -> Optional[tuple]:
    """What makes two tokenizers the same (not ``source``, the path it was read from)."""
    if info is None:
        return None
    return tuple(info.get(key) for key in ("kind", "vocab_size", "eod", "sha256"))


def _tokenizer_name(info: Optional[dict]) -> str:
    if info is None:
        return "no recorded tokenizer"
    return f"{info.get('kind', 'a tokenizer')} (vocabulary {info.get('vocab_size', '?')})"


def order_changes(saved: dict, cfg) -> list[str]:
    """The settings that decide the data order and differ from the checkpoint's (a choice a
    user may make on purpose, e.g. a new blend to anneal on: warned of, not refused)."""
    now = {"seed": cfg.seed, "global_batch": cfg.train.global_batch}
    names = {"seed": "seed", "global_batch": "train.global_batch"}
    if cfg.data.source == "indexed":
        now.update(split=[float(part) for part in cfg.data.split],
                   blend_weights=_blend_weights(cfg.data))
        names.update(split="data.split", blend_weights="data.blend's weights")
    return [f"{names[key]}={_shown(now[key])} (the checkpoint's {_shown(saved[key])})"
            for key in now if key in saved and saved[key] != now[key]]


def _shown(value) -> str:
    if isinstance(value, list):
        return "[" + ",".join(f"{v:g}" for v in value) + "]"
    return str(value)
