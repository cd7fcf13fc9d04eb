"""The llama family's HF interop (its ``ModelSpec.hf_module``): a model with experts that
Mixtral holds, or an HF ``mixtral`` config.json, goes to ``hybrid.interop.mixtral``; one with
experts that Mixtral does not hold (a shared expert, dense layers, unnormalised top-k, q/k
biases or norms), or a ``qwen2_moe`` / ``qwen3_moe`` config.json, to
``hybrid.interop.qwen_moe``; any other to ``hybrid.interop.llama``. The modules keep their own
names; this one only picks."""

from __future__ import annotations

from typing import Any

from hybrid.interop import llama, mixtral, qwen_moe

QWEN_MOE_TYPES = ("qwen2_moe", "qwen3_moe")


def _of_model(model: Any):
    moe = getattr(model, "moe", None)
    if moe is None or moe.experts <= 0:
        return llama
    return qwen_moe if mixtral.beyond_mixtral(model) else mixtral


def to_hf(weights: dict, model: Any) -> dict:
    return _of_model(model).to_hf(weights, model)


def from_hf(tensors: dict, model: Any) -> dict:
    return _of_model(model).from_hf(tensors, model)


def hf_config(model: Any, eod: int | None = None) -> dict:
    return _of_model(model).hf_config(model, eod)


def model_fields(config: dict, source: str) -> dict:
    kind = config.get("model_type")
    module = mixtral if kind == "mixtral" else qwen_moe if kind in QWEN_MOE_TYPES else llama
    return module.model_fields(config, source)
