"""The model registry: one ``ModelSpec`` per family, keyed by ``model.family`` (pure).

A family's spec says, from the ``ModelConfig`` alone, everything planning needs of its model:
each block's parameters (``ParamSpec``s: names, shapes, TP splits), the FLOPs of a layer and
of its attention core, the bytes a layer and the head keep for backward, the shape rules, and
where its torch blocks and its HF name map live (as module names: planning imports no torch).
Every family's model is the same frame of blocks, which the pipeline partitions: block 0 the
embedding, blocks 1..L the layers, block L+1 the head.

A family registered from outside the package (``register_model`` at import of the user's
module) is found by ``model.family_module``: the module ``model_spec`` imports when
``model.family`` is not registered yet, in the launcher and on every rank.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Optional

from hybrid.planning.layout import LayoutError
from hybrid.planning.param_spec import ParamSpec

BYTES = {"fp32": 4, "bf16": 2}
"""Bytes of one element at each ``train.precision``."""


class ModelSpec(ABC):
    """One model family's pure side. Subclass it, set the class attributes, implement the
    methods and ``register_model`` an instance (``hybrid/planning/models/gpt2.py`` is one)."""

    name: str = ""
    """``model.family``'s value."""
    doc: str = ""
    """One line for the docs and ``model.family``'s error."""
    blocks_module: str = ""
    """The torch module that registers the family's blocks (``hybrid.model.families``) when
    imported."""
    hf_module: Optional[str] = None
    """The module with the family's HF name map and config (``to_hf``, ``from_hf``,
    ``hf_config``, ``model_fields``: ``hybrid/interop/gpt2.py``); None: no HF interop."""
    hf_model_type: Optional[str] = None
    """HF's ``model_type`` this family imports."""
    hf_model_types_also: tuple[str, ...] = ()
    """Other HF ``model_type``s it imports (llama: ``mixtral``, its models with experts)."""
    learned_positions: bool = True
    """Whether ``model.seq_len`` is a weight's shape (GPT-2's position table). A family with
    rotary positions sets False: its checkpoints load at any ``model.seq_len``."""

    @abstractmethod
    def block_params(self, m, block_id: int, sequence_parallel: bool) -> dict[str, ParamSpec]:
        """Block ``block_id``'s parameters: local name (as the block module names it, in the
        order its ``named_parameters()`` yields them) -> spec with its global name."""

    @abstractmethod
    def layer_forward_flops(self, m, b: int) -> float:
        """One layer's forward FLOPs over ``b`` sequences of ``m.seq_len`` tokens."""

    def block_forward_flops(self, m, b: int, block_id: int) -> float:
        """Layer ``block_id``'s forward FLOPs (its kind's: ``hybrid.planning.models.layers``);
        a family whose layers are all alike keeps this default, the mean."""
        return self.layer_forward_flops(m, b)

    @abstractmethod
    def attention_core_flops(self, m, b: int) -> float:
        """What selective recompute redoes of a layer (its attention core)."""

    @abstractmethod
    def layer_activation_bytes(self, m, micro_batch: int, tp: int, sp: bool, precision: str,
                               recompute: str = "none", cp: int = 1) -> int:
        """Bytes one layer keeps for backward per micro-batch on one rank."""

    def block_activation_bytes(self, m, block_id: int, micro_batch: int, tp: int, sp: bool,
                               precision: str, recompute: str = "none", cp: int = 1) -> int:
        """Bytes layer ``block_id`` keeps; a family whose layers are all alike keeps this
        default, the mean."""
        return self.layer_activation_bytes(m, micro_batch, tp, sp, precision, recompute, cp)

    @abstractmethod
    def head_activation_bytes(self, m, micro_batch: int, tp: int, sp: bool, precision: str,
                              cp: int = 1) -> int:
        """Bytes the head and the loss keep for backward per micro-batch on one rank."""

    @abstractmethod
    def check_shape(self, m, tp: int) -> None:
        """Raise ``LayoutError`` (one line, the fix) when ``m`` is no valid model of this
        family or ``tp`` does not split what tensor parallelism splits."""

    @abstractmethod
    def valid_tp_sizes(self, m) -> list[int]:
        """The TP sizes that split the model evenly."""


MODELS: dict[str, ModelSpec] = {}
"""The registered families by name."""


def register_model(spec: ModelSpec) -> ModelSpec:
    """Make ``spec`` known by its name (a second registration replaces the first: a module
    imported twice, in a test, registers the same family again)."""
    MODELS[spec.name] = spec
    return spec


def model_families() -> tuple[str, ...]:
    return tuple(MODELS)


def model_spec(m) -> ModelSpec:
    """The spec of ``m.family`` (a ``ModelConfig``), importing ``m.family_module`` first when
    the family is not registered yet; ``LayoutError`` naming the choices if it is unknown."""
    family, module = getattr(m, "family", "gpt2"), getattr(m, "family_module", None)
    if family not in MODELS and module:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise LayoutError(f"model.family_module={module!r} cannot be imported ({err}); "
                              f"put its folder on PYTHONPATH or fix the name") from None
    spec = MODELS.get(family)
    if spec is None:
        where = (f"{module!r} does not register it" if module
                 else "set model.family_module to the module that registers it")
        raise LayoutError(f"model.family={family!r} is unknown; choose one of "
                          f"{', '.join(MODELS)} ({where})")
    return spec


def family_for_hf(model_type: object) -> Optional[ModelSpec]:
    """The registered family that imports HF's ``model_type``, if any."""
    return next((spec for spec in MODELS.values()
                 if model_type in (spec.hf_model_type, *spec.hf_model_types_also)), None)
