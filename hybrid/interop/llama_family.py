"""The llama family's HF interop (its ``ModelSpec.hf_module``): a model with experts, or an
HF ``mixtral`` config.json, goes to ``hybrid.interop.mixtral``, any other to
``hybrid.interop.llama``. Both modules keep their own names; this one only picks."""

from __future__ import annotations

from typing import Any

from hybrid.interop import llama, mixtral


def _of_model(model: Any):
    return mixtral if getattr(model, "experts", 0) > 0 else llama


def to_hf(weights: dict, model: Any) -> dict:
    return _of_model(model).to_hf(weights, model)


def from_hf(tensors: dict, model: Any) -> dict:
    return _of_model(model).from_hf(tensors, model)


def hf_config(model: Any, eod: int | None = None) -> dict:
    return _of_model(model).hf_config(model, eod)


def model_fields(config: dict, source: str) -> dict:
    return (mixtral if config.get("model_type") == "mixtral" else llama).model_fields(config,
                                                                                       source)
