"""A run's data, settled before any rank starts: an indexed source's prefixes resolved to
absolute paths in the plan and megatron-core's index caches built once, here
(``hybrid.data.megatron``); and the data's tokenizer recorded in the plan and copied into the
run directory, for the checkpoints to carry. Used by ``hybrid-train`` and by ``hybrid-plan
out=DIR`` (a run a launcher of the user's starts).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

from hybrid.checkpoint.store import TOKENIZER_FILE
from hybrid.data.dataset import DataError
from hybrid.data.eval_split import check_eval_split
from hybrid.data.examples import user_cache_dir, write_example
from hybrid.data.megatron import build_caches
from hybrid.data.metadata import read_meta, tokenizer_path
from hybrid.data.sources import DATA_CACHE, indexed_spec, resolve_prefixes
from hybrid.files import write_text
from hybrid.planning.data_sources import blend_of
from hybrid.planning.job import JobPlan


def with_run_data(plan: JobPlan, run_dir: Path) -> JobPlan:
    """``plan`` with its data placed and its tokenizer recorded (see the module doc)."""
    data = plan.cfg.data
    if data.source == "indexed":
        chosen = Path(data.cache_dir).expanduser().resolve() if data.cache_dir else None
        cache = chosen or (Path(run_dir) / DATA_CACHE).resolve()
        prefixes = (_built_example(data.example, chosen or user_cache_dir()),) \
            if data.example else resolve_prefixes(data)
        plan = plan.with_data(prefixes, str(cache))
        check_eval_split(plan.cfg, prefixes)  # before megatron builds its indices
        started = time.monotonic()
        if build_caches(indexed_spec(plan)):
            print(f"data: built megatron-core's sample indices in {plan.data_cache_dir} "
                  f"({time.monotonic() - started:.1f} s)", file=sys.stderr)
    recorded = _recorded_data(plan)
    if recorded is None:
        return plan
    meta = read_meta(recorded)
    if tokenizer_path(recorded).is_file():
        write_text(Path(run_dir) / TOKENIZER_FILE, tokenizer_path(recorded).read_text())
    return plan.with_tokenizer(meta["tokenizer"])


def _built_example(name: str, folder: Path) -> str:
    """A built-in corpus's prefix, built once per machine into ``folder``."""
    try:
        prefix, built = write_example(name, folder)
    except OSError as err:
        raise DataError(f"cannot build the built-in corpus {name} into {folder}: "
                        f"{err.strerror or err}; choose a writable folder with "
                        f"data.cache_dir=DIR") from None
    if built:
        print(f"data: built {name} in {Path(prefix).parent}, once for this machine",
              file=sys.stderr)
    return prefix


def _recorded_data(plan: JobPlan) -> Optional[str]:
    """The first data set of the run that hybrid-data recorded (a blend's are checked alike)."""
    data = plan.cfg.data
    if data.source == "tokens":
        candidates = [data.path]
    elif data.source == "indexed":
        candidates = list(plan.data_prefixes) or list(blend_of(data).prefixes)
    else:
        return None
    return next((c for c in candidates if read_meta(c) is not None), None)
