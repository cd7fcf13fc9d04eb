"""Whether a checkpoint's model fits the config's (pure: plain JSON): every shape field is
compared, and a mismatch is refused before launch in one line naming each field that differs
with both values (docs/checkpoints.md).

The fields are one table, ``SHAPE_FIELDS``: a field that stops being a shape (one the weights
do not depend on) leaves it, in this one place. ``model.seq_len`` is not in it: a rotary
family's weights fit any context, a learned-positions one's (GPT-2) are checked apart
(``store._check_context``).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

from hybrid.errors import UserError


class ShapeField(NamedTuple):
    config_key: str
    """The ``model.*`` setting that decides it (the manifest records the resolved size)."""
    moe_only: bool = False
    """Compared only when both models have experts (a dense model has no expert weights)."""


SHAPE_FIELDS = {
    "family": ShapeField("family"),
    "layers": ShapeField("layers"),
    "hidden": ShapeField("hidden"),
    "heads": ShapeField("heads"),
    "kv": ShapeField("kv_heads"),
    "ffn": ShapeField("ffn_hidden"),
    "vocab": ShapeField("vocab"),
    "padded_vocab": ShapeField("vocab_pad_multiple"),
    "tie_embeddings": ShapeField("tie_embeddings"),
    "experts": ShapeField("experts"),
    "moe_ffn": ShapeField("moe_ffn_hidden", moe_only=True),
    "moe_every": ShapeField("moe_every", moe_only=True),
}
"""Manifest name -> the setting that decides it. ``kv``, ``ffn``, ``padded_vocab`` and
``moe_ffn`` are resolved sizes."""
MODEL_SHAPE_FIELDS = (*SHAPE_FIELDS, "seq_len")
"""What a manifest records of the model (``seq_len``: the context it was saved with)."""


def model_shape(model_cfg) -> dict:
    """The fields of ``MODEL_SHAPE_FIELDS`` of a ``ModelConfig``."""
    return {name: getattr(model_cfg, name) for name in MODEL_SHAPE_FIELDS}


def saved_shape(manifest: dict) -> dict:
    """The checkpoint's shape, every field present. A manifest written before a field was
    recorded: a checkpoint from before families is a gpt2, from before ``kv`` has one
    key/value head per head, from before the MoE fields reads them from its saved config's
    model (none saved: dense)."""
    recorded = manifest["model"]
    saved_model = (manifest.get("config") or {}).get("model") or {}
    older = {"family": "gpt2", "kv": recorded.get("heads"),
             "experts": saved_model.get("experts", 0),
             "moe_every": saved_model.get("moe_every", 1),
             "moe_ffn": saved_model.get("moe_ffn_hidden") or recorded.get("ffn")}
    return {name: recorded.get(name, older.get(name)) for name in MODEL_SHAPE_FIELDS}


def shape_mismatches(saved: dict, wanted: dict, padding: bool = True) -> list[str]:
    """The manifest names of the fields that differ (``padding``: the padded vocabulary too;
    weights alone load into any padding)."""
    both_moe = bool(saved.get("experts")) and bool(wanted.get("experts"))
    return [name for name, spec in SHAPE_FIELDS.items()
            if (padding or name != "padded_vocab") and (both_moe or not spec.moe_only)
            and saved.get(name) != wanted[name]]


def mismatch_line(differ: list[str], saved: dict, wanted: dict, path: Path) -> str:
    """One line naming every field that differs, the two values and the fix."""
    there = ", ".join(f"{name}={saved.get(name)}" for name in differ)
    here = ", ".join(f"{name}={wanted[name]}" for name in differ)
    keys = ", ".join(f"model.{SHAPE_FIELDS[name].config_key}" for name in differ)
    fix = " ".join(_setting(name, saved.get(name)) for name in differ)
    return (f"{keys}: the checkpoint {Path(path).name} has {there}, the config {here}; set "
            f"{fix} to match it (hybrid-ckpt show {path} prints its shape)")


def _setting(name: str, value: object) -> str:
    """``model.KEY=VALUE`` that gives the saved size, where one setting does; the key alone
    where the size is resolved from several (``padded_vocab``: vocab_pad_multiple)."""
    key = f"model.{SHAPE_FIELDS[name].config_key}"
    if name == "padded_vocab" or value is None:
        return f"{key} to match"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    return f"{key}={value}"


def check_shape(manifest: dict, model_cfg, path: Path, padding: bool,
                error: type[UserError]) -> Optional[dict]:
    """Raise ``error`` with ``mismatch_line`` when a field differs; else the saved shape."""
    saved, wanted = saved_shape(manifest), model_shape(model_cfg)
    differ = shape_mismatches(saved, wanted, padding)
    if differ:
        raise error(mismatch_line(differ, saved, wanted, path))
    return saved
