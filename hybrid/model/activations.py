"""Measured activation memory: the bytes autograd keeps for backward.

``SavedTensors`` counts, while it is active, every tensor an operation saves for its
backward (``torch.autograd.graph.saved_tensors_hooks``), by distinct storage, leaving out the
parameters (a weight a matmul saves is not activation memory). ``total`` is everything saved
(a storage counted again only if saved anew after its release);
``peak`` is the most held at once, since a saved tensor is released when its backward has run
(or its graph is dropped): the activation peak of a pipeline rank over a step. The cost model's
per-layer formula is checked against this byte for byte (``tests/test_model_tp.py``).
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch


class SavedTensors:
    def __init__(self, parameters: Iterable[torch.Tensor]):
        # By storage object, not address: ZeRO-3 frees a parameter's storage between uses and
        # gathers it again, at another address.
        self._parameters = {p.untyped_storage()._cdata for p in parameters}
        self._holders: dict[int, int] = {}  # storage -> saved tensors holding it now
        self._sizes: dict[int, int] = {}
        self.total = 0
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage._cdata in self._parameters or storage.nbytes() == 0:
            return tensor
        if self._holders.get(key, 0) == 0:
            self._sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            self.total += storage.nbytes()
        self._holders[key] = self._holders.get(key, 0) + 1
        # Autograd holds what we return until the backward consumes it: a box we own, whose
        # release tells us when that is.
        box = _Box(tensor)
        weakref.finalize(box, self._release, key)
        return box

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            self.live -= self._sizes[key]


class _Box:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Box) else packed
