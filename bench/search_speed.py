"""How long ``hybrid-plan search.world=3072`` takes for the 1T-parameter GPT (the issue's
bound: 10 s) while another heavy job runs: the bench starts one busy process per core first
(``--load``), runs the search in-process so that start-up is not counted, stops them, and
prints the best layout, the search's CPU time, the machine's load average (on a shared
machine the wall time is mostly other work's), and ``ratio=<wall seconds / 10 s>`` last.

    .venv/bin/python bench/search_speed.py
    .venv/bin/python bench/search_speed.py --load 0                     # on an idle machine
    .venv/bin/python bench/search_speed.py --model gpt3-125m --world 8   # the smallest (tests)
    .venv/bin/python bench/search_speed.py --software deepspeed-pipe --keep model.recompute \
        --set model.recompute=full                      # a constrained search
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from contextlib import contextmanager

from hybrid.planning.cost.devices import load_device
from hybrid.planning.cost.search import search
from hybrid.planning.cost.search_limits import describe, search_limits
from hybrid.planning.cost.software import SOFTWARE, software_named
from launch.commands.app import compose_plan_config

BOUND_S = 10.0
BUSY = "while True: pass"


@contextmanager
def busy_cores(count: int):
    """``count`` processes that spin on a core each until the block ends (then killed)."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-1t", help="a model preset (conf/model)")
    parser.add_argument("--world", type=int, default=3072, help="devices; also the global batch")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1,
                        help="busy processes running beside the search (default: one a core)")
    parser.add_argument("--software", default="hybrid", choices=list(SOFTWARE),
                        help="the cost.software profile the search prices and is limited to")
    parser.add_argument("--keep", nargs="*", default=[], help="search.keep keys")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides (key=value)")
    args = parser.parse_args()
    cfg = compose_plan_config([f"model={args.model}", f"train.global_batch={args.world}",
                               "train.precision=bf16", *args.set]).job()
    software = software_named(args.software)
    limits = search_limits(cfg, software, args.keep)
    device = load_device("a100-80gb")
    before = os.getloadavg()[0]
    with busy_cores(args.load):
        started, cpu = time.perf_counter(), time.process_time()
        result = search(cfg, args.world, device, top=10, limits=limits)
        seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    print(f"{args.model} on {args.world} a100-80gb, cost.software={software.name}"
          f"{describe(limits)}: {result['considered']} layouts, rejected {result['rejected']}")
    for best in result["candidates"][:1]:
        print(f"best: {best['settings']} predicted {best['predicted']['step_time_s']:.1f} "
              f"s/step, {best['predicted']['tflops_per_device']:.1f} TFLOP/s per device")
    print(f"load={args.load} busy processes on {os.cpu_count()} cores; load average "
          f"{before:.1f} before, {os.getloadavg()[0]:.1f} after (other work on the machine "
          f"included); search cpu_s={cpu_s:.2f}")
    print(f"search_s={seconds:.2f} bound_s={BOUND_S:g} ratio={seconds / BOUND_S:.3f}")


if __name__ == "__main__":
    main()
