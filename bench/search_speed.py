"""How long ``hybrid-plan search.world=3072`` takes for the 1T-parameter GPT (the issue's
bound: 10 s), run in-process so that start-up is not counted; prints the best layout and
``ratio=<seconds / 10 s>`` last.

    .venv/bin/python bench/search_speed.py
"""

from __future__ import annotations

import time

from hybrid.planning.cost.devices import load_device
from hybrid.planning.cost.search import search
from launch.commands.app import compose_plan_config

BOUND_S = 10.0


def main() -> None:
    cfg = compose_plan_config(["model=gpt-1t", "train.global_batch=3072",
                               "train.precision=bf16"]).job()
    device = load_device("a100-80gb")
    started = time.perf_counter()
    result = search(cfg, 3072, device, top=10)
    seconds = time.perf_counter() - started
    best = result["candidates"][0]
    print(f"gpt-1t on 3072 a100-80gb: {result['considered']} layouts, rejected "
          f"{result['rejected']}")
    print(f"best: {best['settings']} predicted {best['predicted']['step_time_s']:.1f} s/step, "
          f"{best['predicted']['tflops_per_device']:.1f} TFLOP/s per device")
    print(f"search_s={seconds:.2f} bound_s={BOUND_S:g} ratio={seconds / BOUND_S:.3f}")


if __name__ == "__main__":
    main()
