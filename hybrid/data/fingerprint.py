"""What a run's data was, for a checkpoint to record and a resume to compare (pure: no torch).

A checkpoint continues a run at a data position: sample ``step * global_batch`` of an order
drawn from ``seed``. Resumed on other data (a token file changed, truncated or swapped) or
with another seed or global batch, the position means something else and the run goes on in
silence on data it never meant to read. Each data file is fingerprinted by its size and a
SHA-256 of its first and last MiB (cheap for any size, and any truncation, append or swap
changes it); generated data has no file and is fully described by the config.
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


def run_data_record(cfg, data_prefixes: tuple[str, ...] = ()) -> dict:
    """What a checkpoint records of its run's data."""
    return {"seed": cfg.seed, "global_batch": cfg.train.global_batch,
            "files": fingerprint(data_files(cfg, data_prefixes))}


def changed_file(saved: list[dict], now: list[dict]) -> Optional[str]:
    """How the run's data files differ from a checkpoint's, as a phrase, or None."""
    if [f["file"] for f in saved] != [f["file"] for f in now]:
        before = ", ".join(f["file"] for f in saved) or "generated data"
        after = ", ".join(f["file"] for f in now) or "generated data"
        return f"it trained on {before}, this run reads {after}"
    for old, new in zip(saved, now):
        if old["bytes"] != new["bytes"]:
            return f"{new['file']} had {old['bytes']:,} bytes then and has {new['bytes']:,} now"
        if old["edges_sha256"] != new["edges_sha256"]:
            return f"{new['file']} has the same size but other contents than then"
    return None


def order_changes(saved: dict, cfg) -> list[str]:
    """The settings that decide the data order and differ from the checkpoint's."""
    now = {"seed": cfg.seed, "global_batch": cfg.train.global_batch}
    names = {"seed": "seed", "global_batch": "train.global_batch"}
    return [f"{names[key]}={now[key]} (the checkpoint's {saved[key]})"
            for key in now if key in saved and saved[key] != now[key]]
