"""Training data: the sources, the loader, and ``hybrid-data``'s tokenizing (docs/data.md).

- ``dataset``: what every source gives the loader (``TokenDataset``) and ``DataError``;
- ``synthetic``, ``token_file``, ``megatron`` (+ ``indexed``, the format): the three sources;
- ``sources``: the source a config names, opened on a rank or checked before launch;
- ``loader``: layout-independent global batches and a DP rank's micro-batches;
- ``tokenizer``, ``documents``, ``prepare``, ``metadata``: ``hybrid-data``'s side.

Nothing here imports torch at import time: the launcher checks data before any worker starts.
"""

from hybrid.data.dataset import DataError, TokenDataset
from hybrid.data.loader import (epoch_permutation, global_batch_indices, rank_microbatches,
                                steps_per_epoch)
from hybrid.data.sources import make_dataset, open_dataset, open_eval_dataset, validate_data
from hybrid.data.synthetic import MarkovDataset, markov_entropy
from hybrid.data.token_file import TOKEN_DTYPES, TokenFileDataset, max_token

__all__ = ["DataError", "TokenDataset", "epoch_permutation", "global_batch_indices",
           "rank_microbatches", "steps_per_epoch", "make_dataset", "open_dataset", "open_eval_dataset",
           "validate_data", "MarkovDataset", "markov_entropy", "TOKEN_DTYPES",
           "TokenFileDataset", "max_token"]
