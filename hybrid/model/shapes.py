"""Model shape arithmetic and checks: pure Python, no torch, so planners and launchers can use
it before any worker starts (``import hybrid.model.shapes`` does not import megatron-core).

``param_count`` is exact: it equals ``sum(p.numel())`` of the 1-process model. Against the
standard GPT formula ``12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h))`` (one ``V×h`` matrix, no
final norm; ``V`` here is the padded vocabulary), with ``f = 4h``:

    tied:    param_count = formula + 2h            (the final layer norm)
    untied:  param_count = formula + 2h + V·h      (plus the separate output matrix)
"""

from __future__ import annotations

from hybrid.config import ModelConfig
from hybrid.cost import layer_params
from hybrid.cost import param_count as total_params
from hybrid.layout import LayoutError, valid_sizes


class ModelConfigError(ValueError):
    """A model shape that cannot be built (e.g. hidden not divisible by heads)."""


def layer_param_count(cfg: ModelConfig) -> int:
    """One transformer layer: two norms, QKV and projection, two MLP matrices, with biases."""
    return layer_params(cfg).total


def param_count(cfg: ModelConfig) -> int:
    """Total parameters of the 1-process model (shared tied weights counted once)."""
    return total_params(cfg)


def check_model_config(cfg: ModelConfig) -> None:
    """Shape rules that hold on any layout."""
    for name in ("layers", "hidden", "heads", "vocab", "seq_len", "vocab_pad_multiple", "ffn"):
        if getattr(cfg, name) < 1:
            raise ModelConfigError(f"model.{name}={getattr(cfg, name)} must be >= 1")
    if cfg.hidden % cfg.heads:
        raise ModelConfigError(f"model.hidden={cfg.hidden} is not divisible by "
                               f"model.heads={cfg.heads}; choose heads in "
                               f"{valid_sizes(cfg.hidden)[:12]}")


def valid_tp_sizes(cfg: ModelConfig) -> list[int]:
    """TP sizes that split heads, the MLP and the padded vocabulary evenly."""
    return [d for d in valid_sizes(cfg.heads)
            if cfg.ffn % d == 0 and cfg.padded_vocab % d == 0]


def check_model_fits(cfg: ModelConfig, tp: int) -> None:
    """``check_model_config``, then ``LayoutError`` unless ``tp`` divides what it splits."""
    check_model_config(cfg)
    splits = {"model.heads": cfg.heads, "model.ffn": cfg.ffn,
              "the padded vocabulary": cfg.padded_vocab}
    for what, size in splits.items():
        if size % tp:
            raise LayoutError(f"parallel.tp={tp} does not divide {what}={size}; "
                              f"choose tp in {valid_tp_sizes(cfg)}")
