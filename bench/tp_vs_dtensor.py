"""hybrid's tensor parallelism against torch DTensor tensor parallelism, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/tp_vs_dtensor.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/tp_vs_dtensor.py --ranks 2 --steps 6 --no-sp

Both sides run the same GPT (pre-norm LayerNorm layers, fused QKV with bias, causal SDPA, GELU
tanh MLP, learned positions, untied head to the padded vocabulary), fp32, the same batch, in the
same gloo processes (one thread each), tp = 2 and 4:

- hybrid: ``hybrid.model.GPT`` on ``Layout(tp=N)`` (megatron-core layers, vocab-parallel
  embedding and cross entropy); with ``sp``, Megatron sequence parallelism plus the per-step
  all-reduce of the norms' and row biases' partial gradients.
- dtensor: a plain torch module with the same parameter names, given the full weights of
  hybrid's tp=1 model (so both first losses agree), then ``parallelize_module`` on a 1-D CPU
  mesh: ``ColwiseParallel`` QKV and fc1, ``RowwiseParallel`` proj, fc2 and embedding, a
  ``ColwiseParallel`` head with ``Shard(-1)`` logits and ``loss_parallel`` (no logits gather);
  with ``sp``, torchtitan's ``SequenceParallel`` norms and ``PrepareModuleInput`` all-gathers.
  QKV is one linear whose columns are laid out ``[heads, 3, head_dim]`` (hybrid's layout), so a
  colwise shard holds whole heads and the backward does one input-gradient all-reduce, as
  hybrid does (torchtitan's separate q, k, v linears would do three).

A step is zero-grad + forward + backward (no optimizer). Steps alternate between the sides; 2
warm-up steps, then the median over the timed steps of the wall time (slowest rank) and of the
CPU-seconds (``time.process_time``, all ranks together, gloo's threads included). "floor": the
TP collectives one hybrid step issues (counted by ``CommCounter``), replayed back to back with
no compute on the same group; "dtensor issues" is DTensor's count (``CommDebugMode``). The last
line is ``ratio=<hybrid wall / dtensor wall>`` at tp=2 without sp (tp=4's on the line before).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.comm import CommCounter  # noqa: E402
from hybrid.planning.config import ModelConfig  # noqa: E402
from hybrid.groups import ParallelGroups  # noqa: E402
from hybrid.planning.layout import Layout  # noqa: E402
from hybrid.model import GPT, allreduce_sequence_parallel_grads  # noqa: E402
from hybrid.testing import spawn  # noqa: E402

SEED, WARMUP = 7, 2


class SizedCounter(CommCounter):
    """A ``CommCounter`` that also keeps each collective's kind and payload bytes."""

    def __init__(self, groups):
        super().__init__(groups)
        self.log: list[tuple[str, int]] = []

    def collective(self, group, op, kind, payload, issue, waits, sent=0):
        self.log.append((op.replace("_", "-"), payload))
        return super().collective(group, op, kind, payload, issue, waits, sent)


# ----- the plain torch model: hybrid's parameter names, activations [b, s, h] ------------------
class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.padded_vocab, cfg.hidden)
        self.position_embeddings = nn.Parameter(torch.zeros(cfg.seq_len, cfg.hidden))

    def forward(self, tokens):
        return self.word_embeddings(tokens) + self.position_embeddings[:tokens.shape[1]]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):
        qkv = self.qkv(x)  # local [b, s, 3h/tp]: this rank's heads, each [q, k, v]
        b, s = qkv.shape[:2]
        q, k, v = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(context.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = nn.Sequential(collections.OrderedDict(
            fc1=nn.Linear(cfg.hidden, cfg.ffn), gelu=nn.GELU(approximate="tanh"),
            fc2=nn.Linear(cfg.ffn, cfg.hidden)))

    def forward(self, x):
        x = x + self.attention(self.input_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def torch_gpt(cfg: ModelConfig, reference: GPT) -> nn.Sequential:
    """The plain model, ``blocks.*`` named as hybrid's, holding the tp=1 model's weights."""
    model = nn.Module()
    head = nn.Sequential(collections.OrderedDict(
        final_norm=nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps),
        output_layer=nn.Linear(cfg.hidden, cfg.padded_vocab, bias=False)))
    model.blocks = nn.Sequential(Embed(cfg), *[Layer(cfg) for _ in range(cfg.layers)], head)
    full = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(full[name])
    return model.blocks


def parallelize(model: nn.Sequential, mesh, sp: bool) -> None:
    """torchtitan's TP plan (with ``sp``, its sequence-parallel variant) on our names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    row_out = Shard(1) if sp else Replicate()
    top = {"0.word_embeddings": RowwiseParallel(input_layouts=Replicate()),
           f"{len(model) - 1}.output_layer": ColwiseParallel(
               input_layouts=row_out, output_layouts=Shard(-1), use_local_output=False)}
    if sp:  # the position add needs the whole sequence, so scatter after it, as hybrid does
        top["0"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        top[f"{len(model) - 1}.final_norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for layer in list(model)[1:-1]:
        plan = {"attention.qkv": ColwiseParallel(), "mlp.fc1": ColwiseParallel(),
                "attention.proj": RowwiseParallel(output_layouts=row_out),
                "mlp.fc2": RowwiseParallel(output_layouts=row_out)}
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),))
            plan.update({"input_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                         "attention": gather, "mlp": gather})
        parallelize_module(layer, mesh, plan)


# ----- steps, counts and the floor --------------------------------------------------------------
def hybrid_step(model: GPT, groups, batch, sp: bool) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    if sp:
        allreduce_sequence_parallel_grads(model.blocks, groups.tensor)
    return loss.item()


def dtensor_step(model: nn.Module, batch) -> float:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    tokens, labels = batch
    model.zero_grad(set_to_none=True)
    with loss_parallel():
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
    for param in model.parameters():
        # DTensor leaves the sequence-parallel norms' gradients Partial (summed only when
        # something reads them); complete them here, as hybrid's step does.
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(placements=param.placements)
    return loss.to_local().item()


def dtensor_collectives(step) -> str:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        step()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()}
    return f"{mode.get_total_counts()} ({', '.join(f'{n} {op}' for op, n in counts.items())})"


def replay(log: list[tuple[str, int]], group, reps: int) -> float:
    """Median seconds (this rank) to issue ``log``'s collectives back to back, no compute."""
    world, calls = group.size(), []
    for op, payload in log:
        full = torch.ones(max(1, payload // 4))  # fp32; the 8-byte int64 flag becomes 2 floats
        part = torch.ones(full.numel() // world)
        calls.append({"all-reduce": lambda f=full: group.all_reduce(f),
                      "all-gather": lambda f=full, p=part: group.all_gather_into(f, p),
                      "reduce-scatter": lambda f=full, p=part: group.reduce_scatter_into(p, f),
                      }[op])
    times = []
    for _ in range(WARMUP + reps):
        group.barrier()
        start = time.perf_counter()
        for call in calls:
            call()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def _timed(run, group) -> tuple[float, float, float]:
    group.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    loss = run()
    return time.perf_counter() - wall, time.process_time() - cpu, loss


def _worker(rank, world, args):
    from torch.distributed.device_mesh import init_device_mesh

    # Fired by DTensor's module hooks on every backward (the embedding's input is integers).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    cfg = model_config(args)
    reference = GPT(cfg, ParallelGroups.create(Layout()), seed=SEED)  # full weights, tp=1
    groups = ParallelGroups.create(Layout(tp=world))
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab, (args.batch, args.seq + 1), generator=gen)
    batch = (data[:, :-1].contiguous(), data[:, 1:].contiguous())
    out = {}
    for sp in args.variants:
        hybrid = GPT(cfg, groups, seed=SEED, sequence_parallel=sp)
        plain = torch_gpt(cfg, reference)
        parallelize(plain, mesh, sp)
        runs = {"hybrid": lambda: hybrid_step(hybrid, groups, batch, sp),
                "dtensor": lambda: dtensor_step(plain, batch)}
        record = {side: [] for side in runs}
        for _ in range(WARMUP + args.steps):
            for side, run in runs.items():
                record[side].append(_timed(run, groups.tensor))
        counter = SizedCounter(groups)
        with counter.track():
            runs["hybrid"]()
        out[sp] = dict(record=record, log=counter.log, dtensor=dtensor_collectives(runs["dtensor"]),
                       floor=replay(counter.log, groups.tensor, args.steps))
    return out


# ----- driver -----------------------------------------------------------------------------------
def model_config(args) -> ModelConfig:
    return ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=256,
                       seq_len=args.seq)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def summarise(tp: int, results: list, sp: bool) -> float:
    """Print one line for this rank count and variant; return hybrid wall / dtensor wall."""
    parts, walls = [], {}
    for side in ("hybrid", "dtensor"):
        steps = [[r[sp]["record"][side][i] for r in results] for i in range(len(
            results[0][sp]["record"][side]))]
        wall = statistics.median(max(t[0] for t in s) for s in steps[WARMUP:])
        cpu = statistics.median(sum(t[1] for t in s) for s in steps[WARMUP:])
        walls[side] = wall
        parts.append(f"{side} wall {wall:.3f} s cpu {cpu:.2f} s loss {steps[0][0][2]:.5f}")
    first = results[0][sp]
    kinds = collections.Counter(first["log"])
    floor = max(r[sp]["floor"] for r in results)
    what = ", ".join(f"{n} {op} x {_size(b)}" for (op, b), n in sorted(
        kinds.items(), key=lambda kv: -kv[0][1]))
    print(f"tp={tp}{' sp' if sp else '   '} {parts[0]} | {parts[1]} | floor: {len(first['log'])}"
          f" collectives ({what}) = {floor:.4f} s | dtensor issues {first['dtensor']}",
          flush=True)
    return walls["hybrid"] / walls["dtensor"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-sp", action="store_true", help="skip the sequence-parallel runs")
    args = parser.parse_args()
    args.variants = [False] if args.no_sp else [False, True]
    cfg = model_config(args)
    print(f"GPT layers={cfg.layers} hidden={cfg.hidden} heads={cfg.heads} seq={args.seq} "
          f"batch={args.batch} vocab={cfg.vocab} (padded {cfg.padded_vocab}), fp32, gloo, 1 "
          f"thread per rank, {os.cpu_count()} CPUs; fwd+bwd per step, median of {args.steps}; "
          f"loss: hybrid vocab-parallel CE, dtensor loss_parallel (no logits gather)", flush=True)
    ratios = {}
    for tp in args.ranks:
        if tp > (os.cpu_count() or 1):
            print(f"tp={tp}: more ranks than the {os.cpu_count()} CPUs; they share cores")
        results = spawn(_worker, tp, args, timeout=3600)
        for sp in args.variants:
            ratio = summarise(tp, results, sp)
            if not sp:
                ratios[tp] = ratio
    for tp in sorted(ratios, reverse=True):
        print(f"ratio={ratios[tp]:.3f}" if tp == min(ratios) else f"tp={tp} ratio={ratios[tp]:.3f}")


if __name__ == "__main__":
    main()
