"""What every data source gives the loader, and the one error class of bad data."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hybrid.errors import UserError


class DataError(UserError):
    """A data setting or data file that cannot work; the message names the field and the fix."""


class TokenDataset(Protocol):
    """What the loader needs: ``len``, sample ``i`` as int64 ``[seq_len + 1]``, and whether
    the source orders its samples itself (``ordered``: megatron-core's GPTDataset shuffles
    by its own seed, so sample ``k`` of the run is sample ``k`` of the data set; otherwise the
    loader visits each epoch in a seeded permutation)."""

    seq_len: int
    ordered: bool

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...
