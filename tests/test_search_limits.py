"""A search the user constrains (#56): ``search.keep`` holds settings at the config's values,
``search.schedules`` limits the schedules, ``cost.software`` offers only what that software
runs; each candidate carries the kept values and the best equals the best of the full search
filtered by hand (so the pruning stays sound), and a profile is named in every prediction."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hybrid.planning.config import Config, ModelConfig, TrainConfig
from hybrid.planning.cost.devices import PRESETS
from hybrid.planning.cost.search import search
from hybrid.planning.cost.search_limits import (
    KEEPABLE, SearchLimitError, SearchLimits, search_limits,
)
from hybrid.planning.cost.software import (
    HYBRID, MEGATRON_LM_2021, SOFTWARE, SoftwareError, software_named,
)

A100 = PRESETS["a100-80gb"]
PLAN = str(Path(sys.executable).parent / "hybrid-plan")
GPT_1B = ModelConfig(name="1.3b", layers=24, hidden=2048, heads=16, vocab=51200,
                     vocab_pad_multiple=128, seq_len=2048, tie_embeddings=True)
GPT_2B = ModelConfig(name="2.7b", layers=32, hidden=2560, heads=32, vocab=51200,
                     vocab_pad_multiple=128, seq_len=4096, tie_embeddings=True)


def config(model: ModelConfig, global_batch: int, **parallel) -> Config:
    cfg = Config(model=replace(model, recompute=parallel.pop("recompute", "none")),
                 train=TrainConfig(global_batch=global_batch, micro_batch=1, precision="bf16"))
    cfg.parallel = replace(cfg.parallel, **parallel)
    cfg.cost = replace(cfg.cost, device="a100-80gb")
    return cfg


def best(result: dict) -> tuple:
    first = result["candidates"][0]
    return first["settings"], first["predicted"]["step_time_s"]


def by_hand(cfg: Config, world: int, keep, limits: SearchLimits = SearchLimits()) -> tuple:
    """The first candidate of the full search that ``keep(settings)`` accepts. The full
    search is exact for any ``top`` (``tests/test_search.py``), so its first ``top`` are the
    first of all: asked for more until one is accepted (simulating all would take minutes)."""
    top = 8
    while True:
        found = search(cfg, world, A100, top=top, limits=limits)["candidates"]
        first = next((c for c in found if keep(c["settings"])), None)
        if first is not None:
            return first["settings"], first["predicted"]["step_time_s"]
        assert len(found) == top, "no layout of the full search is accepted"
        top *= 4


CASES = [(GPT_1B, 64, 8, dict(zero=1, recompute="full"), ["parallel.zero", "model.recompute"]),
         (GPT_1B, 128, 16, dict(tp=2, sequence_parallel=True),
          ["parallel.tp", "parallel.sequence_parallel"]),
         (GPT_2B, 32, 8, dict(pp=2, cp=2), ["parallel.pp", "parallel.cp"])]


@pytest.mark.parametrize("model, batch, world, sets, keep", CASES,
                         ids=[f"{m.name}-w{w}-{'+'.join(k)}" for m, _, w, _, k in CASES])
def test_kept_settings_hold_and_the_best_is_the_full_searchs_best_filtered(
        model, batch, world, sets, keep):
    cfg = config(model, batch, **sets)
    kept = search_limits(cfg, keep=keep).kept
    assert set(kept) == {KEEPABLE[k] for k in keep}
    expected = by_hand(cfg, world,
                       lambda s: all(s[name] == value for name, value in kept.items()))
    for top in (1, 5):
        limited = search(cfg, world, A100, top=top, limits=search_limits(cfg, keep=keep))
        assert limited["candidates"]
        for c in limited["candidates"]:
            assert all(c["settings"][name] == value for name, value in kept.items())
        assert best(limited) == expected


def test_schedules_limit_what_the_search_offers():
    cfg = config(GPT_1B, 128)
    for schedules in (["1f1b"], ["interleaved-1f1b", "zb-h1"]):
        limits = search_limits(cfg, schedules=schedules)
        limited = search(cfg, 16, A100, top=3, limits=limits)
        # with one stage every schedule runs alike: the search tries only the first allowed
        assert all(c["settings"]["schedule"] in schedules for c in limited["candidates"])
        assert best(limited) == by_hand(cfg, 16, lambda s: s["schedule"] in schedules)


@pytest.mark.parametrize("world", [8, 16])
def test_a_profile_offers_only_what_its_software_runs(world):
    """megatron-lm-2021: 1F1B or interleaved, no ZeRO, no SP, no CP, none or full recompute;
    the best equals the best of the same pricing with every layout offered, filtered."""
    cfg = config(GPT_1B, 64)
    unlimited = replace(MEGATRON_LM_2021, schedules=None, zero_stages=None, recompute=None,
                        sequence_parallel=True, context_parallel=True)
    limited = search(cfg, world, A100, top=3, limits=search_limits(cfg, MEGATRON_LM_2021))
    runs = lambda s: all(MEGATRON_LM_2021.allows(k, s[k]) for k in  # noqa: E731
                         ("schedule", "zero", "recompute", "sequence_parallel", "cp"))
    assert limited["software"] == "megatron-lm-2021" and limited["candidates"]
    assert all(runs(c["settings"]) for c in limited["candidates"])
    assert best(limited) == by_hand(cfg, world, runs, SearchLimits(software=unlimited))


def test_what_cannot_hold_is_refused_in_one_line():
    cfg = config(GPT_1B, 64, zero=2)
    with pytest.raises(SearchLimitError, match="parallel.zeros.*choose among parallel.dp"):
        search_limits(cfg, keep=["parallel.zeros"])
    with pytest.raises(SearchLimitError, match="zb-hx.*choose among"):
        search_limits(cfg, schedules=["zb-hx"])
    with pytest.raises(SearchLimitError, match="parallel.zero=2.*megatron-lm-2021"):
        search_limits(cfg, MEGATRON_LM_2021, keep=["parallel.zero"])
    with pytest.raises(SearchLimitError, match="none that cost.software=megatron-lm-2021"):
        search_limits(cfg, MEGATRON_LM_2021, schedules=["zb-h1"])
    with pytest.raises(SoftwareError, match="'megatron' is unknown; choose one of " +
                       ", ".join(SOFTWARE)):
        software_named("megatron")
    assert software_named("hybrid") is HYBRID


def test_hybrid_plan_names_the_software_and_refuses_an_unknown_one():
    common = [PLAN, "model=gpt3-1.3b", "train.global_batch=64", "cost.device=a100-80gb",
              "parallel.tp=2", "parallel.pp=2"]
    text = subprocess.run([*common, "cost.software=megatron-lm-2021"],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "running megatron-lm-2021 (cost.software): step " in text.stdout
    as_json = subprocess.run([*common, "cost.software=megatron-lm-2021", "format=json"],
                             capture_output=True, text=True, timeout=120)
    predicted = json.loads(as_json.stdout)["predicted"]
    assert predicted["software"] == "megatron-lm-2021"
    hybrid = json.loads(subprocess.run([*common, "format=json"], capture_output=True,
                                       text=True, timeout=120).stdout)["predicted"]
    assert hybrid["software"] == "hybrid"
    assert predicted["step_time_s"] != hybrid["step_time_s"]  # it prices another stack
    bad = subprocess.run([*common, "cost.software=nemo"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and bad.stdout == ""
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cost.software='nemo' is unknown; choose one of "
                      f"{', '.join(SOFTWARE)}"]


def test_hybrid_plan_search_keeps_and_names_the_software():
    done = subprocess.run([PLAN, "model=gpt3-1.3b", "train.global_batch=64", "search.world=8",
                           "search.top=3", "cost.device=a100-80gb", "model.recompute=full",
                           "search.keep=[model.recompute]", "search.schedules=[1f1b]",
                           "cost.software=megatron-lm-2021"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    header = done.stdout.splitlines()[0]
    assert "cost.software=megatron-lm-2021; kept recompute=full, schedules 1f1b" in header
