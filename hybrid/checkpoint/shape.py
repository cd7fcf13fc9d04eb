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
from hybrid.planning.moe_config import nest_model
from hybrid.planning.moved_keys import get_path


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
    "head_size": ShapeField("head_dim"),
    "qkv_bias": ShapeField("qkv_bias"),
    "qk_norm": ShapeField("qk_norm"),
    "experts": ShapeField("moe.experts"),
    "moe_ffn": ShapeField("moe.ffn_hidden", moe_only=True),
    "moe_every": ShapeField("moe.every", moe_only=True),
    "moe_dense_layers": ShapeField("moe.dense_layers", moe_only=True),
    "moe_shared_ffn_hidden": ShapeField("moe.shared_ffn_hidden", moe_only=True),
}
"""Manifest name -> the setting that decides it. ``kv``, ``ffn``, ``padded_vocab``,
``head_size`` and ``moe_ffn`` are resolved sizes. The variants' ``head_dim``, ``qkv_bias`` and
``qk_norm`` decide which tensors exist and their shapes (Qwen2's biases, Qwen3's norms). The
manifest names stay those it has always recorded (``moe_every``); the settings are nested
(``model.moe.every``)."""
RECORDED_FROM = {"experts": "moe.experts", "moe_every": "moe.every",
                 "moe_dense_layers": "moe.dense_layers",
                 "moe_shared_ffn_hidden": "moe.shared_ffn_hidden"}
"""Manifest name -> the ``ModelConfig`` attribute it records, where they differ."""
WEIGHT_FREE_FIELDS = ("rope_base", "rope_scaling", "norm_eps", "sliding_window", "moe.topk")
"""``model.*`` settings no weight depends on: a checkpoint loads under another value (a
context-extension fine-tune changes the rope on purpose, as Megatron and torchtitan allow);
``setting_changes`` names those that differ."""
LLAMA3_FACTORS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                  "rope_original_positions")
"""``model.rope_scaling=llama3``'s settings: compared where either side scales so."""
MODEL_SHAPE_FIELDS = (*SHAPE_FIELDS, "seq_len")
"""What a manifest records of the model (``seq_len``: the context it was saved with)."""


def model_shape(model_cfg) -> dict:
    """The fields of ``MODEL_SHAPE_FIELDS`` of a ``ModelConfig``."""
    return {name: get_path(model_cfg, RECORDED_FROM.get(name, name))
            for name in MODEL_SHAPE_FIELDS}


def saved_shape(manifest: dict) -> dict:
    """The checkpoint's shape, every field present. A manifest written before a field was
    recorded: a checkpoint from before families is a gpt2, from before ``kv`` has one
    key/value head per head, from before the MoE and variant fields reads them from its saved
    config's model (none saved: dense, a head of hidden/heads, no q/k/v bias or norm)."""
    recorded = manifest["model"]
    saved_model = nest_model((manifest.get("config") or {}).get("model") or {})
    moe = saved_model.get("moe") or {}
    hidden, heads = recorded.get("hidden"), recorded.get("heads")
    older = {"family": "gpt2", "kv": heads,
             "head_size": saved_model.get("head_dim") or (hidden // heads if hidden and heads
                                                          else None),
             "qkv_bias": saved_model.get("qkv_bias", False),
             "qk_norm": saved_model.get("qk_norm", False),
             "experts": moe.get("experts", 0), "moe_every": moe.get("every", 1),
             "moe_dense_layers": moe.get("dense_layers", []),
             "moe_shared_ffn_hidden": moe.get("shared_ffn_hidden", 0),
             "moe_ffn": moe.get("ffn_hidden") or recorded.get("ffn")}
    return {name: recorded.get(name, older.get(name)) for name in MODEL_SHAPE_FIELDS}


def shape_mismatches(saved: dict, wanted: dict, padding: bool = True) -> list[str]:
    """The manifest names of the fields that differ (``padding``: the padded vocabulary too;
    weights alone load into any padding)."""
    both_moe = bool(saved.get("experts")) and bool(wanted.get("experts"))
    differ = [name for name, spec in SHAPE_FIELDS.items()
              if (padding or name != "padded_vocab") and (both_moe or not spec.moe_only)
              and saved.get(name) != wanted[name]]
    if _head_follows_the_width(saved) and _head_follows_the_width(wanted) and \
            ("hidden" in differ or "heads" in differ):
        # Neither side sets head_dim: the head size differs because hidden or heads does,
        # and setting those (the fix the line gives) brings it along.
        differ = [name for name in differ if name != "head_size"]
    return differ


def _head_follows_the_width(shape: dict) -> bool:
    """Whether the head size is hidden / heads (no explicit ``model.head_dim``)."""
    hidden, heads = shape.get("hidden"), shape.get("heads")
    return bool(hidden and heads) and shape.get("head_size") == hidden // heads


def mismatch_line(differ: list[str], saved: dict, wanted: dict, path: Path) -> str:
    """One line naming every field that differs, the two values and the fix."""
    there = ", ".join(f"{name}={_text(saved.get(name))}" for name in differ)
    here = ", ".join(f"{name}={_text(wanted[name])}" for name in differ)
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
    return f"{key}={_text(value)}"


def check_shape(manifest: dict, model_cfg, path: Path, padding: bool,
                error: type[UserError]) -> Optional[dict]:
    """Raise ``error`` with ``mismatch_line`` when a field differs; else the saved shape."""
    saved, wanted = saved_shape(manifest), model_shape(model_cfg)
    differ = shape_mismatches(saved, wanted, padding)
    if differ:
        raise error(mismatch_line(differ, saved, wanted, path))
    return saved


def setting_changes(manifest: dict, model_cfg) -> list[str]:
    """``model.KEY=VALUE (the checkpoint's: SAVED)`` for each weight-free setting
    (``WEIGHT_FREE_FIELDS``) that differs from the checkpoint's saved config; [] where none
    does or the checkpoint saved no config."""
    saved = nest_model((manifest.get("config") or {}).get("model") or {})
    names = list(WEIGHT_FREE_FIELDS)
    if "llama3" in (saved.get("rope_scaling"), model_cfg.rope_scaling):
        names += LLAMA3_FACTORS
    found = {name: _saved(saved, name) for name in names}
    return [f"model.{name}={_text(get_path(model_cfg, name))} (the checkpoint's: "
            f"{_text(found[name])})" for name in names
            if found[name] is not _ABSENT and found[name] != get_path(model_cfg, name)]


_ABSENT = object()


def _saved(saved: dict, path: str) -> object:
    """The value at ``path`` (``moe.topk``) of a saved model section; ``_ABSENT`` if none."""
    for name in path.split("."):
        if not isinstance(saved, dict) or name not in saved:
            return _ABSENT
        saved = saved[name]
    return saved


def _text(value: object) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)
