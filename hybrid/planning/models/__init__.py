"""Model families: the registry (``registry.py``) and the registered ones (pure).

Adding a family: a module here (or anywhere, found by ``model.family_module``) defining a
``ModelSpec`` and calling ``register_model``, its blocks registered on the torch side
(``hybrid.model.families``); built-in ones are imported below. See docs/models.md.
"""

from hybrid.planning.models.registry import (BYTES, MODELS, ModelSpec, family_for_hf,
                                             model_families, model_spec, register_model)
from hybrid.planning.models import gpt2, llama  # noqa: F401  (register "gpt2", "llama")

__all__ = ["BYTES", "MODELS", "ModelSpec", "family_for_hf", "model_families", "model_spec",
           "register_model"]
