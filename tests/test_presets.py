"""Presets mean what they say (#51): each planning preset carries its published training batch
(a user's ``train.global_batch=`` still wins), every parameter count the docs cite is the
published one, and ``hybrid-plan``'s search says plainly what rules its layouts out."""

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from hybrid.planning.config import PlanConfig
from hybrid.planning.cost.search import (
    MICRO_BATCHES, candidates, searched_cps, searched_schedules, searched_shardings,
)
from hybrid.planning.cost.sizes import published_param_count
from hybrid.planning.layout import valid_sizes
from hybrid.planning.validate import RECOMPUTE, valid_tp_sizes
from tests.test_param_count import load_preset

ROOT = Path(__file__).resolve().parents[1]
PLAN = str(Path(sys.executable).parent / "hybrid-plan")

PUBLISHED_BATCH = {
    # Brown et al. 2020, Table 2.1: batch in tokens / 2048 positions
    "gpt3-125m": 256, "gpt3-350m": 256, "gpt3-760m": 256, "gpt3-1.3b": 512, "gpt3-2.7b": 512,
    "gpt3-6.7b": 1024, "gpt3-13b": 1024, "gpt3-175b": 1536,
    "gpt-1t": 3072,  # Narayanan et al. 2021, Table 1
    "llama3-8b": 512, "llama3-70b": 512,  # 4M tokens at 8192 positions (the presets' notes)
}

PUBLISHED_PARAMS = {
    # HF checkpoints' safetensors metadata, as docs/models.md cites them
    "gpt2-124m": 124_439_808, "gpt2-350m": 354_823_168,
    "smollm-135m": 134_515_008, "smollm-360m": 361_821_120,
    "tinyllama-1.1b": 1_100_048_384, "llama3.2-1b": 1_235_814_400,
    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
}


def composed(*overrides: str):
    from launch.commands.app import CONF_DIR, register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("plan", overrides=list(overrides))


@pytest.mark.parametrize("name, batch", sorted(PUBLISHED_BATCH.items()))
def test_planning_presets_carry_their_published_batch_and_an_override_wins(name, batch):
    cfg = composed(f"model={name}")
    assert (cfg.model.name, cfg.train.global_batch) == (name, batch)
    assert composed(f"model={name}", "train.global_batch=64").train.global_batch == 64
    assert composed("train.global_batch=64", f"model={name}").train.global_batch == 64


def test_the_main_job_and_the_tiny_presets_keep_the_base_batch():
    for overrides in ([], ["model=tiny"], ["model=llama-tiny"], ["model=smollm-360m"]):
        assert composed(*overrides).train.global_batch == 16, overrides


@pytest.mark.parametrize("name, published", sorted(PUBLISHED_PARAMS.items()))
def test_every_cited_parameter_count_is_the_published_one(name, published):
    assert published_param_count(load_preset(name)) == published


def test_the_plan_names_the_published_count_and_the_padding_apart():
    """smollm-360m pads its vocabulary to a multiple of 640 (tp 5): the plan printed 361,944,000
    parameters, SmolLM-360M has 361,821,120."""
    done = subprocess.run([PLAN, "model=smollm-360m", "parallel=single"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("361,821,120 parameters (361,944,000 with the padded vocabulary)"
            in done.stdout.splitlines()[0])


def test_gpt3_175b_searched_at_its_published_batch_keeps_most_layouts():
    done = subprocess.run([PLAN, "model=gpt3-175b", "search.world=1024", "search.top=1",
                           "cost.device=a100-80gb", "format=json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["global_batch"] == 1536
    assert result["rejected"].get("invalid train.global_batch", 0) < result["considered"] / 4
    assert result["candidates"][0]["predicted"]["tflops_per_device"] > 60  # was 15 at 16


def searched_by_schedule(world: int, *overrides: str) -> Counter:
    """The layouts ``hybrid-plan search.world=world`` enumerates, by schedule, before any
    check (``search.candidates``)."""
    cfg = to_plan_config(composed(*overrides))
    return Counter(c.parallel.schedule for c in candidates(cfg, world))


def to_plan_config(dict_cfg) -> PlanConfig:
    from launch.commands.app import to_dataclass

    return to_dataclass(dict_cfg, PlanConfig)


def layouts_by_pipelining(model, world: int, gpus_per_node: int = 8) -> tuple[int, int]:
    """(one-stage layouts, pipelined layouts of one (schedule, vpp)) of the searched axes,
    counted from the axes alone: each (tp, cp, pp) split times micro-batches, ZeRO stages
    (dp x cp > 1 only), sequence parallelism (tp > 1 only) and recompute modes."""
    counts = [0, 0]
    for tp in [t for t in valid_tp_sizes(model) if world % t == 0 and t <= gpus_per_node]:
        for cp in searched_cps(model.seq_len, world // tp):
            for pp in [p for p in valid_sizes(world // (tp * cp)) if p <= model.layers]:
                width = world // (tp * pp)  # dp x cp
                zeros = len(searched_shardings()) if width > 1 else 1
                counts[pp > 1] += (len(MICRO_BATCHES) * zeros * (2 if tp > 1 else 1)
                                   * len(RECOMPUTE))
    return counts[0], counts[1]


@pytest.mark.parametrize("name, world, total", [("gpt3-175b", 1024, 10416),
                                                ("llama3-70b", 64, 16308)])
def test_the_search_counts_are_its_layouts_times_its_schedules(name, world, total):
    """The counts the two tests below print, taken apart: a pipelined layout is tried once per
    searched (schedule, vpp) pair (1f1b, interleaved-1f1b at 2 and 4 chunks, zb-h1, and since
    #54 dualpipev: 5), a one-stage layout once (every schedule runs it alike). dualpipev
    added one pipelined share: gpt3-175b 336 + 4 x 2016 = 8400 became 336 + 5 x 2016, and
    llama3-70b 1008 + 4 x 3060 = 13248 became 1008 + 5 x 3060."""
    one_stage, pipelined = layouts_by_pipelining(load_preset(name), world)
    pairs = searched_schedules(pp=2)
    assert [s for s, _ in pairs] == ["1f1b", "interleaved-1f1b", "interleaved-1f1b", "zb-h1",
                                     "dualpipev"]
    by_schedule = searched_by_schedule(world, f"model={name}")
    assert by_schedule == {"1f1b": one_stage + pipelined, "interleaved-1f1b": 2 * pipelined,
                           "zb-h1": pipelined, "dualpipev": pipelined}
    assert sum(by_schedule.values()) == one_stage + len(pairs) * pipelined == total


def test_a_batch_that_rules_out_most_layouts_is_said_with_the_override_to_try():
    """7560 of 10416: the search's own count of layouts refused for the batch (before #54's
    dualpipev, 6120 of 8400; dualpipev's 2016 layouts add 1440, as many as zb-h1's, since the
    batch rule reads dp and micro_batch only). Layouts refused first for another reason (the
    pp, the schedule, a lower ZeRO stage that fits) are not in it, so it stays below the
    arithmetic count of (dp, micro_batch) that do not divide 16."""
    done = subprocess.run([PLAN, "model=gpt3-175b", "search.world=1024", "search.top=1",
                           "cost.device=a100-80gb", "train.global_batch=16"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    considered = sum(searched_by_schedule(1024, "model=gpt3-175b").values())
    assert considered == 10416
    assert (f"train.global_batch=16 rules out 7560 of {considered} layouts (dp x micro_batch "
            "must divide it): try train.global_batch=1024, or the model's published batch"
            ) in done.stdout
    assert "rejected: 7560 invalid train.global_batch," in done.stdout
    cfg = to_plan_config(composed("model=gpt3-175b", "train.global_batch=16"))
    indivisible = sum(1 for c in candidates(cfg, 1024)
                      if 16 % (c.parallel.dp * c.train.micro_batch))
    assert considered / 2 < 7560 <= indivisible


def test_a_model_too_large_for_the_default_device_points_to_cost_device():
    """docs/models.md's llama3-70b search on the default cpu device: one line whose counts add
    up to the layouts tried, naming cost.device; with a GPU preset it plans."""
    done = subprocess.run([PLAN, "model=llama3-70b", "search.world=64"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, lines
    tried, said = re.search(r"of (\d+) tried, (.*?); e\.g\.", lines[0]).groups()
    counts = [int(part.split()[0]) for part in said.split(", ")]
    assert sum(counts) == int(tried) and "too large for device memory" in said
    assert "have does" not in lines[0] and "cost.device=a100-80gb" in lines[0]
    done = subprocess.run([PLAN, "model=llama3-70b", "search.world=64", "search.top=1",
                           "cost.device=h100-80gb"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "1 best of 16308 layouts for 64 devices" in done.stdout
