"""hybrid's llama training step against HF ``LlamaForCausalLM``'s, in one process.

    .venv/bin/python bench/llama_vs_hf.py                     # SmolLM-135M's shape, 4 layers
    .venv/bin/python bench/llama_vs_hf.py --layers 2 --seq 256 --steps 6

Same shape, same weights (hybrid's exported to HF's names: ``hybrid.interop.llama.to_hf``),
same batch, same threads, AdamW with the same settings on both; one step is forward,
backward, optimizer step. The two alternate step by step, so load from other processes hits
both alike. Prints each side's median and minimum step time and, last, ``ratio=<hybrid/HF>``
of the medians (lower is better) after the ratio of the minima, and the first step's losses
(equal up to float rounding: the same model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hybrid.groups import ParallelGroups  # noqa: E402
from hybrid.interop.llama import to_hf  # noqa: E402
from hybrid.model import GPT  # noqa: E402
from hybrid.planning.config import ModelConfig  # noqa: E402
from hybrid.planning.layout import Layout  # noqa: E402


def _models(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = ModelConfig(family="llama", layers=args.layers, hidden=576, heads=9, kv_heads=3,
                      ffn_hidden=1536, vocab=49152, vocab_pad_multiple=128, seq_len=args.seq)
    ours = GPT(cfg, ParallelGroups.create(Layout()), seed=1)
    weights = {p.spec.name: p.detach() for p in ours.parameters()}
    theirs = LlamaForCausalLM(LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        max_position_embeddings=args.seq, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
        attn_implementation="sdpa"))
    theirs.load_state_dict(to_hf(weights, cfg), strict=True)
    return cfg, ours, theirs


def _step(model, optimizer, tokens, labels, hf: bool) -> tuple[float, float]:
    start = time.perf_counter()
    if hf:
        logits = model(tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    else:
        loss = model(tokens, labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg, ours, theirs = _models(args)
    sides = {"hybrid": (ours, False), "hf": (theirs, True)}
    optims = {name: torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
              for name, (model, _) in sides.items()}
    times = {name: [] for name in sides}
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps + 1):
        tokens = torch.randint(0, cfg.vocab, (args.batch, args.seq), generator=gen)
        labels = torch.randint(0, cfg.vocab, (args.batch, args.seq), generator=gen)
        for name, (model, hf) in (sides.items() if step % 2 else reversed(sides.items())):
            seconds, loss = _step(model, optims[name], tokens, labels, hf)
            if step == 0:
                print(f"{name}: first loss {loss:.6f}")
            else:  # step 0 warms up
                times[name].append(seconds)
    for name, values in times.items():
        print(f"{name}: step median {statistics.median(values) * 1e3:.1f} ms, "
              f"min {min(values) * 1e3:.1f} ms")
    print(f"ratio(min)={min(times['hybrid']) / min(times['hf']):.3f}")
    print(f"ratio={statistics.median(times['hybrid']) / statistics.median(times['hf']):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
