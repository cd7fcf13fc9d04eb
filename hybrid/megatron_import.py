"""Import megatron-core without paying for compilers hybrid never runs.

megatron-core decorates its fused element-wise kernels (``megatron.core.fusions``) with
``torch.compile`` as they are imported, and ``torch.compile`` imports TorchDynamo and Inductor
on the spot even though it compiles nothing until the first call. That is about 3 s of CPU
in every process that imports megatron-core: a third of a worker fork server's start-up and a
sixth of a small job's whole CPU time on a 2-core machine (measured with py-spy on a tp2 job).
hybrid calls none of those kernels (its layers' forwards are its own, see
``hybrid.model.megatron_adapter``), so while megatron-core is first imported ``torch.compile``
is a stand-in that calls the real one on the decorated function's first call: what
``torch.compile`` does anyway, minus the eager import. Importing this module loads no torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from types import ModuleType
from typing import Any, Callable, Iterator


def import_megatron(name: str = "megatron.core") -> ModuleType:
    """``importlib.import_module(name)`` for a part of megatron-core, its package imported
    first (once per process) with ``torch.compile`` deferred."""
    if "megatron.core" not in sys.modules:
        import torch

        with compile_deferred(torch):
            importlib.import_module("megatron.core")
    return importlib.import_module(name)


@contextlib.contextmanager
def compile_deferred(torch: Any) -> Iterator[None]:
    """Within the block, ``torch.compile(fn, ...)`` (and its decorator form) returns ``fn``
    wrapped so that the real ``torch.compile`` runs at the first call; restored after."""
    real = torch.compile
    torch.compile = deferred_compile(real)
    try:
        yield
    finally:
        torch.compile = real


def deferred_compile(real: Callable) -> Callable:
    """A ``torch.compile`` look-alike that hands ``real`` the function on its first call."""

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile_later(fn, **options)
        compiled = []

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    return compile_later
