"""A run's data, settled before any rank starts: an indexed source's prefixes resolved to
absolute paths in the plan and megatron-core's index caches built once, here
(``hybrid.data.megatron``); and the data's tokenizer recorded in the plan and copied into the
run directory, for the checkpoints to carry. A run of ``model.from_hf=HF_DIR`` whose folder
holds a ``tokenizer.json`` takes that tokenizer: the built-in corpus is tokenized with it, data
that records another is refused in one line, and data that records none (synthetic, Megatron's
own files) gets it recorded, so ``hybrid-generate`` and export decode with it. Used by
``hybrid-train`` and by ``hybrid-plan out=DIR`` (a run a launcher of the user's starts).
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
from hybrid.data.tokenizer import HFTokenizer, load_tokenizer
from hybrid.interop.hf_dir import hf_config, hf_tokenizer
from hybrid.data.sources import DATA_CACHE, indexed_spec, resolve_prefixes, validate_data
from hybrid.files import write_text
from hybrid.planning.data_sources import blend_of, evaluates, has_validation_split
from hybrid.planning.job import JobPlan


def with_run_data(plan: JobPlan, run_dir: Path) -> JobPlan:
    """``plan`` with its data placed and its tokenizer recorded (see the module doc)."""
    data = plan.cfg.data
    hf = hf_folder_tokenizer(plan.cfg.model)
    if data.source == "indexed":
        chosen = Path(data.cache_dir).expanduser().resolve() if data.cache_dir else None
        cache = chosen or (Path(run_dir) / DATA_CACHE).resolve()
        prefixes = (_built_example(data.example, chosen or user_cache_dir(), hf),) \
            if data.example else resolve_prefixes(data)
        plan = plan.with_data(prefixes, str(cache))
        check_eval_split(plan.cfg, prefixes)  # before megatron builds its indices
        started = time.monotonic()
        if build_caches(indexed_spec(plan)):
            print(f"data: built megatron-core's sample indices in {plan.data_cache_dir} "
                  f"({time.monotonic() - started:.1f} s)", file=sys.stderr)
    recorded = _recorded_data(plan)
    if recorded is None and hf is not None:  # no tokenizer of the data's: the model's
        write_text(Path(run_dir) / TOKENIZER_FILE, hf.to_json())
        return plan.with_tokenizer(hf.info.to_dict())
    if recorded is None:
        return plan
    meta = read_meta(recorded)
    if hf is not None and meta["tokenizer"]["sha256"] != hf.info.sha256:
        raise DataError(f"{recorded} was tokenized with {meta['tokenizer']['source']}, not the "
                        f"tokenizer of model.from_hf={plan.cfg.model.from_hf}; tokenize it "
                        f"with hybrid-data --tokenizer {plan.cfg.model.from_hf}")
    if tokenizer_path(recorded).is_file():
        write_text(Path(run_dir) / TOKENIZER_FILE, tokenizer_path(recorded).read_text())
    return plan.with_tokenizer(meta["tokenizer"])


def check_eval_early(cfg) -> None:
    """The evaluation's reads against the validation split (``check_eval_split``), before
    the plan is built: a large global batch that evaluation would read the split more than
    once with is refused in a second, not after its schedule is built. A data set not yet
    on disk is left to ``validate_data``'s one line (the check runs again in
    ``with_run_data``). Where it refuses, ``validate_data``'s refusal, if any, is the one
    given, as it would be without this early check."""
    data = cfg.data
    if not (data.source == "indexed" and has_validation_split(data)
            and evaluates(cfg.eval, data)):
        return
    if data.example:
        chosen = Path(data.cache_dir).expanduser().resolve() if data.cache_dir else None
        prefixes = (_built_example(data.example, chosen or user_cache_dir(),
                                   hf_folder_tokenizer(cfg.model)),)
    else:
        prefixes = resolve_prefixes(data)
        if not all(Path(f"{p}{suffix}").is_file() for p in prefixes for suffix in (".bin", ".idx")):
            return
    try:
        check_eval_split(cfg, prefixes)
    except DataError:  # a problem of the data itself (its vocabulary, its files) comes first
        validate_data(cfg.data, cfg.model, cfg.train, cfg.eval)
        raise


def hf_folder_tokenizer(model) -> Optional[HFTokenizer]:
    """The tokenizer of ``model.from_hf``'s folder, as ``hybrid-data --tokenizer HF_DIR``
    builds it (end of document: tokenizer_config.json's eos_token, else config.json's
    eos_token_id); None without a folder or its ``tokenizer.json``. Its ids are checked
    against the model's vocabulary first, in one line."""
    if model.from_hf is None:
        return None
    folder = Path(model.from_hf).expanduser().resolve()
    found = hf_tokenizer(str(folder), model.vocab)
    if found is None:
        return None
    tokenizer, _, eos = found
    if eos is None:
        eos_id = hf_config(str(folder)).get("eos_token_id")
        eos = tokenizer.id_to_token(eos_id) if isinstance(eos_id, int) else None
    return load_tokenizer(str(folder), eos)


def _built_example(name: str, folder: Path, tokenizer: Optional[HFTokenizer]) -> str:
    """A built-in corpus's prefix, built once per machine into ``folder`` (with the
    tokenizer of ``model.from_hf``'s folder, where it has one, else byte by byte)."""
    spec = None if tokenizer is None else (
        tokenizer.info.source, tokenizer.tokenizer.id_to_token(tokenizer.info.eod),
        tokenizer.info.sha256)
    try:
        prefix, built = write_example(name, folder, spec)
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
