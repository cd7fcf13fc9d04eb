"""A run's indexed data, settled before any rank starts: its prefixes resolved to absolute
paths in the plan, and megatron-core's index caches built once, here (``hybrid.data.megatron``).
Used by ``hybrid-train`` and by ``hybrid-plan out=DIR`` (a run a launcher of the user's starts).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hybrid.data.megatron import build_caches
from hybrid.data.sources import DATA_CACHE, indexed_spec, resolve_prefixes
from hybrid.planning.job import JobPlan


def with_run_data(plan: JobPlan, run_dir: Path) -> JobPlan:
    """``plan`` with its indexed data placed (absolute prefixes, the cache folder:
    ``data.cache_dir``, else ``<run dir>/data_cache``) and that folder's caches built; other
    sources unchanged."""
    data = plan.cfg.data
    if data.source != "indexed":
        return plan
    cache = Path(data.cache_dir).expanduser() if data.cache_dir else Path(run_dir) / DATA_CACHE
    plan = plan.with_data(resolve_prefixes(data), str(cache.resolve()))
    started = time.monotonic()
    if build_caches(indexed_spec(plan)):
        print(f"data: built megatron-core's sample indices in {plan.data_cache_dir} "
              f"({time.monotonic() - started:.1f} s)", file=sys.stderr)
    return plan
