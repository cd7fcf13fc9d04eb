"""Shape rules every family shares (pure): positive sizes, heads dividing hidden, TP
splitting what it splits. A family's ``check_shape`` calls these, then adds its own."""

from __future__ import annotations

from typing import Callable

from hybrid.planning.layout import LayoutError, valid_sizes

SIZES = ("layers", "hidden", "heads", "vocab", "seq_len", "vocab_pad_multiple")
"""The fields every family needs >= 1."""


def positive(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{field}={value!r} must be an integer >= 1")


def tp_divides(tp: int, field: str, value: int, fits: Callable[[], list[int]]) -> None:
    """``parallel.tp`` must divide ``field``; the line names the TP sizes that fit."""
    if value % tp:
        raise LayoutError(f"parallel.tp={tp} does not divide {field}={value}; "
                          f"choose tp in {{{', '.join(map(str, fits()))}}}")


def check_common_shape(m, tp: int, fits: Callable[[], list[int]]) -> None:
    """Sizes >= 1, heads dividing hidden, tp dividing the heads, the MLP and the padded
    vocabulary (``fits``: the family's valid TP sizes, for the fix)."""
    for name in SIZES:
        positive(f"model.{name}", getattr(m, name))
    if m.hidden % m.heads:
        raise LayoutError(f"model.heads={m.heads} does not divide model.hidden={m.hidden}; "
                          f"choose heads in {{{', '.join(map(str, valid_sizes(m.hidden)))}}}")
    positive("model.ffn_hidden", m.ffn)
    tp_divides(tp, "model.heads", m.heads, fits)
    tp_divides(tp, "model.ffn_hidden", m.ffn, fits)
    if m.padded_vocab % tp:
        raise LayoutError(
            f"parallel.tp={tp} does not divide the padded vocabulary {m.padded_vocab} "
            f"(model.vocab={m.vocab} padded to a multiple of model.vocab_pad_multiple="
            f"{m.vocab_pad_multiple}); set model.vocab_pad_multiple to a multiple of {tp}")


def common_tp_sizes(m) -> list[int]:
    """TP sizes that split the heads, the MLP and the padded vocabulary evenly."""
    return [d for d in valid_sizes(m.heads) if m.ffn % d == 0 and m.padded_vocab % d == 0]
