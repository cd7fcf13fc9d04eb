"""Generation with the key/value cache against recomputing the prefix every token.

    .venv/bin/python bench/generate_cache.py                 # 256 new tokens, both families
    .venv/bin/python bench/generate_cache.py --new 128 --threads 2

One process, one model per family (random weights, 4 layers, hidden 256, 512 positions), the
same 16-token prompt, greedy: each side generates ``--new`` tokens (the cache and the
recompute alternate, ``--repeats`` times each; the minimum counts). Prints both times, whether
the ids are equal (they must be), and per family ``speedup=<recompute/cache>`` and, last,
``ratio=<cache/recompute>`` (lower is better).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.generate import Source, generate, one_process_model  # noqa: E402
from hybrid.planning.config import ModelConfig  # noqa: E402
from hybrid.planning.params import model_param_specs  # noqa: E402

SHAPE = dict(layers=4, hidden=256, heads=8, vocab=4096, seq_len=512)
FAMILIES = {"gpt2": {}, "llama": dict(family="llama", kv_heads=2, ffn_hidden=704)}


def _source(family: str) -> Source:
    cfg = ModelConfig(**SHAPE, **FAMILIES[family])
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(spec.shape, generator=gen) * 0.05
               for name, spec in model_param_specs(cfg).items()}
    return Source(cfg, weights, None, None, family)


def _timed(model, prompt, new: int, cache: bool) -> tuple[float, list[int]]:
    start = time.perf_counter()
    ids = generate(model, prompt, max_new_tokens=new, temperature=0.0, top_k=0, seed=0,
                   eod=None, cache=cache)
    return time.perf_counter() - start, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompt = list(range(1, 17))
    for family in FAMILIES:
        with one_process_model(_source(family)) as model:
            times = {True: [], False: []}
            ids = {}
            for _ in range(args.repeats):
                for cache in (True, False):
                    seconds, ids[cache] = _timed(model, prompt, args.new, cache)
                    times[cache].append(seconds)
        cached, recomputed = min(times[True]), min(times[False])
        print(f"{family}: {args.new} new tokens: cache {cached:.2f} s, recompute "
              f"{recomputed:.2f} s, same ids: {ids[True] == ids[False]}, "
              f"speedup={recomputed / cached:.2f}x ratio={cached / recomputed:.3f}")


if __name__ == "__main__":
    main()
