"""How long ``hybrid-plan search.world=3072`` takes for the 1T-parameter GPT (the issue's
bound: 10 s), run in-process so that start-up is not counted; prints the best layout and
``ratio=<seconds / 10 s>`` last.

    .venv/bin/python bench/search_speed.py
    .venv/bin/python bench/search_speed.py --model gpt3-125m --world 8   # the smallest (tests)
"""

from __future__ import annotations

import argparse
import time

from hybrid.planning.cost.devices import load_device
from hybrid.planning.cost.search import search
from launch.commands.app import compose_plan_config

BOUND_S = 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-1t", help="a model preset (conf/model)")
    parser.add_argument("--world", type=int, default=3072, help="devices; also the global batch")
    args = parser.parse_args()
    cfg = compose_plan_config([f"model={args.model}", f"train.global_batch={args.world}",
                               "train.precision=bf16"]).job()
    device = load_device("a100-80gb")
    started = time.perf_counter()
    result = search(cfg, args.world, device, top=10)
    seconds = time.perf_counter() - started
    best = result["candidates"][0]
    print(f"{args.model} on {args.world} a100-80gb: {result['considered']} layouts, rejected "
          f"{result['rejected']}")
    print(f"best: {best['settings']} predicted {best['predicted']['step_time_s']:.1f} s/step, "
          f"{best['predicted']['tflops_per_device']:.1f} TFLOP/s per device")
    print(f"search_s={seconds:.2f} bound_s={BOUND_S:g} ratio={seconds / BOUND_S:.3f}")


if __name__ == "__main__":
    main()
