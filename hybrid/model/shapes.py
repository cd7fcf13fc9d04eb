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
from hybrid.validate import check_model_shape, valid_tp_sizes

__all__ = ["param_count", "layer_param_count", "check_model_config", "check_model_fits",
           "valid_tp_sizes"]


def layer_param_count(cfg: ModelConfig) -> int:
    """One transformer layer: two norms, QKV and projection, two MLP matrices, with biases."""
    return layer_params(cfg).total


def param_count(cfg: ModelConfig) -> int:
    """Total parameters of the 1-process model (shared tied weights counted once)."""
    return total_params(cfg)


def check_model_config(cfg: ModelConfig) -> None:
    """Shape rules that hold on any layout (``hybrid.validate`` owns the rules)."""
    check_model_shape(cfg, 1)


def check_model_fits(cfg: ModelConfig, tp: int) -> None:
    """``LayoutError`` unless the model is well formed and ``tp`` divides what it splits."""
    check_model_shape(cfg, tp)
