"""The DP strategies' facts (pure): one spec per sharding (``parallel.zero``) and per reduction
(exact, or a lossy option), registered in ``registry``; their runtimes live in ``hybrid.dp``.

Import strategies from here: importing the package registers the built-in ones, in this order
(the order of ``hybrid-plan``'s DP table and of ``parallel.dp_compress``'s choices).
"""

from hybrid.planning.strategies import zero  # registers the shardings
from hybrid.planning.strategies import exact  # registers, in this order, the reductions
from hybrid.planning.strategies import bf16
from hybrid.planning.strategies import powersgd
from hybrid.planning.strategies import local_sgd
from hybrid.planning.strategies import delayed
from hybrid.planning.strategies.base import (
    BF16, SCALAR, DpOptions, DpTime, RankTraffic, ReductionSpec, ShardingSpec, all_reduce_bytes,
    scatter_bytes,
)
from hybrid.planning.strategies.registry import (
    REDUCTIONS, SHARDINGS, compress_names, option_problem, reduction_of, register_reduction,
    register_sharding, sharding_of,
)

BUILT_IN = (zero, exact, bf16, powersgd, local_sgd, delayed)

__all__ = ["BF16", "REDUCTIONS", "SCALAR", "SHARDINGS", "DpOptions", "DpTime", "RankTraffic",
           "ReductionSpec", "ShardingSpec", "all_reduce_bytes", "compress_names",
           "option_problem", "reduction_of", "register_reduction", "register_sharding",
           "scatter_bytes", "sharding_of"]
