"""Settings that moved into a nested section keep their flat names of before.

``parallel.zero`` now lives at ``parallel.dp_strategy.zero.stage`` (``dp_config``) and
``model.experts`` at ``model.moe.experts`` (``moe_config``). Each section names, once, in a
table (flat name -> path inside the section), where each flat key went; ``flat_keys`` gives
the owning dataclass those names as arguments and attributes, and ``nest`` moves them in a
saved dict (a ``config.json`` or checkpoint manifest of before). Pure: no torch.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Mapping


def get_path(settings: Any, path: str) -> Any:
    for name in _names(path):
        settings = getattr(settings, name)
    return settings


@functools.lru_cache(maxsize=None)
def _names(path: str) -> tuple[str, ...]:
    """A path's names (a search reads the flat keys of before 180,000 times)."""
    return tuple(path.split("."))


def with_path(settings: Any, path: str, value: Any) -> Any:
    """A copy of ``settings`` with ``path`` set (the nested dataclasses are never mutated:
    ``replace`` shares them between configs)."""
    head, _, rest = path.partition(".")
    return replace(settings, **{head: with_path(getattr(settings, head), rest, value)
                                if rest else value})


def _alias(section: str, path: str) -> property:
    def get(self):
        return get_path(getattr(self, section), path)

    def put(self, value):
        setattr(self, section, with_path(getattr(self, section), path, value))
    return property(get, put, doc=f"The flat name of ``{section}.{path}``.")


def flat_keys(section: str, keys: Mapping[str, str]):
    """A class decorator: give a dataclass with a ``section`` field the flat ``keys``, each an
    attribute (read and written through to its new place) and an argument of ``__init__``
    (so ``dataclasses.replace(cfg, old_name=1)`` works), applied after the fields. The table
    is kept on the class as ``flat_keys_of_before`` (for ``config.from_dict``)."""
    def decorate(cls: type) -> type:
        for flat, path in keys.items():
            setattr(cls, flat, _alias(section, path))
        generated = cls.__init__

        @functools.wraps(generated)
        def __init__(self, **kwargs):
            given = {flat: kwargs.pop(flat) for flat in keys if flat in kwargs}
            generated(self, **kwargs)
            for flat, value in given.items():
                setattr(self, flat, value)

        cls.__init__ = __init__
        cls.flat_keys_of_before = dict(keys)
        return cls
    return decorate


def nest(saved: Mapping[str, Any], section: str, keys: Mapping[str, str]) -> dict:
    """``saved`` (a section of a saved config, plain JSON) with its flat keys of before moved
    under ``section`` (``{"experts": 4}`` -> ``{"moe": {"experts": 4}}``); a flat key wins
    over one already nested, as the dataclass applies it after the fields."""
    out = {key: value for key, value in saved.items() if key not in keys}
    moved = [(path, saved[flat]) for flat, path in keys.items() if flat in saved]
    if not moved:
        return out
    inner = _copy(out.get(section) or {})
    for path, value in moved:
        *parents, leaf = path.split(".")
        level = inner
        for name in parents:
            level = level.setdefault(name, {})
        level[leaf] = value
    out[section] = inner
    return out


def _copy(tree: Mapping[str, Any]) -> dict:
    return {key: _copy(value) if isinstance(value, Mapping) else value
            for key, value in tree.items()}
