"""Expert parallelism's token exchange against the expert compute, ep1 vs ep2 vs ep4 on gloo.

    .venv/bin/python bench/moe_dispatch.py [--tokens 512] [--hidden 256] [--ffn 512]
        [--experts 8] [--topk 2] [--eps 1 2 4] [--repeats 5]
    .venv/bin/python bench/moe_dispatch.py --smoke   # the smallest run (the test suite's)

For each ep, ``ep`` gloo processes each route ``--tokens`` tokens to ``--topk`` of
``--experts`` experts with an even load (token ``t``'s slot ``j`` goes to expert
``(t * topk + j) % experts``: every expert gets the same number of slots, so the bytes are
known in advance) and run one MoE layer's forward as ``hybrid.model.moe`` does: the
dispatch (the slot counts' all-to-all, then the rows' all-to-all with uneven splits through
``hybrid.comm.Group``), each local expert's SwiGLU on its rows, the combine (the outputs'
all-to-all back). Per ep it prints rank 0's dispatch + combine time per token slot, the expert
compute's, the bytes rank 0's ``CommCounter`` counted over the expert group and the bytes
``hybrid-plan``'s model (``hybrid.planning.cost.moe_traffic.a2a_layer_bytes``, forward only)
predicts, and ``ratio=<exchange / compute>`` last. At ep=1 nothing moves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _even_routing(tokens: int, topk: int, experts: int):
    import torch

    slots = torch.arange(tokens * topk).view(tokens, topk)
    return slots % experts


def _rank(rank: int, world: int, args) -> dict:
    import torch

    from hybrid.comm import CommCounter
    from hybrid.groups import ParallelGroups
    from hybrid.model.moe_dispatch import all_to_all, plan_dispatch, run_experts
    from hybrid.planning.layout import Layout

    torch.set_num_threads(1)
    groups = ParallelGroups.create(Layout(dp=world, ep=world))
    group, local = groups.expert, args.experts // world
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    gate = torch.randn(local, args.ffn, args.hidden, generator=gen) / args.hidden ** 0.5
    up = torch.randn(local, args.ffn, args.hidden, generator=gen) / args.hidden ** 0.5
    down = torch.randn(local, args.hidden, args.ffn, generator=gen) / args.ffn ** 0.5

    def expert(j, rows):
        return (torch.nn.functional.silu(rows @ gate[j].t()) * (rows @ up[j].t())) @ down[j].t()

    ids = _even_routing(args.tokens, args.topk, args.experts)
    keep = torch.ones_like(ids, dtype=torch.bool)
    counter = CommCounter(groups)
    exchange, compute, counted = [], [], 0.0
    with torch.no_grad():
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            counter.reset()
            with counter.track():
                if world > 1:
                    group.barrier()  # start together: the exchange waits for no late rank
                t0 = time.perf_counter()
                plan = plan_dispatch(ids, keep, args.experts, group)
                rows = all_to_all(x[plan.token], group, plan.recv, plan.send)
                t1 = time.perf_counter()
                y = run_experts(rows, plan.local_expert, local, expert)
                t2 = time.perf_counter()
                all_to_all(y, group, plan.send, plan.recv)
                t3 = time.perf_counter()
            if repeat:
                exchange.append((t1 - t0) + (t3 - t2))
                compute.append(t2 - t1)
                counted = counter.snapshot()["ep"]["bytes"]
    return {"exchange": statistics.median(exchange), "compute": statistics.median(compute),
            "counted": counted}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="the smallest run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.ffn, args.experts, args.eps, args.repeats = \
            32, 16, 32, 4, [1, 2], 1

    from hybrid.planning.cost.moe_traffic import a2a_layer_bytes
    from hybrid.testing import spawn

    slots = args.tokens * args.topk
    print(f"moe dispatch: {args.tokens} tokens x top-{args.topk} of {args.experts} experts, "
          f"hidden {args.hidden}, expert ffn {args.ffn}, gloo, forward, even load")
    for ep in args.eps:
        result = spawn(_rank, ep, args, timeout=600)[0]
        predicted = a2a_layer_bytes(tokens=args.tokens, hidden=args.hidden, topk=args.topk,
                                    experts=args.experts, ep=ep, backward=False)
        status = "=" if result["counted"] == predicted else "!="
        print(f"ep={ep}  dispatch+combine {result['exchange'] / slots * 1e6:8.2f} us/slot  "
              f"experts {result['compute'] / slots * 1e6:8.2f} us/slot  "
              f"bytes counted {result['counted']:,.0f} {status} predicted {predicted:,.0f}  "
              f"ratio={result['exchange'] / result['compute']:.3f}")
        if status != "=":
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
