"""Device files (pure: no torch): where ``hybrid-plan calibrate`` writes this host's, the record
each carries of where, when and by which hybrid it was measured, and the check that refuses
one measured on another machine or by another hybrid.

A calibration describes one machine as one version of hybrid measured it: on another host its
figures are another machine's, and another hybrid may measure (or price) differently. A sweep
once priced its cells on a file an earlier run had left in the cache and came out 61% off
without a word, so every prediction now names the file it used and its age
(``trust.assumption_line``), and a stale file is refused in one line, never used quietly:
recalibrating on the spot would take minutes of every core inside a command that only plans.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from hybrid.errors import UserError
from hybrid.files import user_cache_dir, write_text

RECORD = "calibration"
"""The key of a device file's record: ``{"host", "hybrid", "at"}`` (``at``: epoch seconds)."""
SOURCE_FIELDS = ("file", "file_time")
"""``Device`` fields that say where a loaded device came from; never written to a file."""


class DeviceError(UserError):
    """``cost.device`` names no preset and no readable device file, names a file measured on
    another machine or by another hybrid, or a link setting is out of range: one line with
    the fix."""


def this_host() -> str:
    return socket.gethostname()


def hybrid_version() -> str:
    try:
        return metadata.version("hybrid")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def calibrated_path() -> Path:
    """Where ``hybrid-plan calibrate`` writes this host's device file by default: beside the
    data cache (``hybrid.files.user_cache_dir``)."""
    return user_cache_dir() / f"device-{this_host()}.json"


@dataclass(frozen=True)
class DeviceFile:
    path: str
    measured_at: float
    """Epoch seconds: the record's time (``hybrid-plan calibrate``'s), else the file's
    modification time (a device written by hand)."""


def write_device_file(fields: dict, path: Path) -> None:
    """A device's fields (``Device.to_dict``) and this host's record, written whole."""
    record = {"host": this_host(), "hybrid": hybrid_version(), "at": time.time()}
    kept = {name: value for name, value in fields.items() if name not in SOURCE_FIELDS}
    write_text(path, json.dumps(kept | {RECORD: record}, indent=1) + "\n")


def read_device_file(path: Path, setting: str) -> tuple[dict, DeviceFile]:
    """A device file's fields and where they came from; a file measured on another host or by
    another hybrid (or a calibration older than the record) is refused in one line."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DeviceError(f"{setting}: cannot read {path} ({err}); run hybrid-plan calibrate "
                          f"again or give another file") from None
    if not isinstance(data, dict):
        raise DeviceError(f"{setting}: {path} is not a JSON object of a device's fields")
    record = data.pop(RECORD, None)
    problem = stale(record, str(data.get("name", "")))
    if problem:
        raise DeviceError(f"{setting}: {path} {problem}; run hybrid-plan calibrate on this "
                          f"machine (it writes {calibrated_path()})")
    when = float(record["at"]) if record else path.stat().st_mtime
    return data, DeviceFile(str(path), when)


def stale(record: dict | None, name: str) -> str:
    """Why a file's record rules it out here ('' when it does not)."""
    if record is None:  # a hand-written device has no record; a calibration always has
        return ("is a calibration with no record of its host and hybrid version (written "
                "before they were kept)" if name.startswith("calibrated:") else "")
    if not isinstance(record, dict) or set(record) != {"host", "hybrid", "at"}:
        return f"has a record {record!r} that is not {{host, hybrid, at}}"
    if record["host"] != this_host():
        return (f"was calibrated on host {record['host']!r}, not this one ({this_host()!r}): "
                f"its figures are that machine's")
    if record["hybrid"] != hybrid_version():
        return (f"was calibrated by hybrid {record['hybrid']}, this is hybrid "
                f"{hybrid_version()}: what calibrate measures may have changed")
    return ""


def age(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.2 h``, ``5.1 days``."""
    if seconds < 90:
        return f"{max(seconds, 0):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def source_said(path: str, measured_at: float, now: float | None = None) -> str:
    """``device file PATH, measured 3.2 h ago`` ('' for a preset)."""
    if not path:
        return ""
    now = time.time() if now is None else now
    return f"device file {path}, measured {age(now - measured_at)} ago"


def source_dict(path: str, measured_at: float, now: float | None = None) -> dict | None:
    """The same for ``format=json``: ``{"path", "measured_at", "age_s"}`` (None: a preset)."""
    if not path:
        return None
    now = time.time() if now is None else now
    return {"path": path, "measured_at": measured_at, "age_s": round(now - measured_at, 1)}
