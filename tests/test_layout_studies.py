"""#42: the cost model orders Narayanan et al. 2021's own layout studies (section 5) as the
paper does, and Table 1's published splits and throughputs as far as the first-principles
terms carry it (hybrid/planning/cost/layout_studies.py, held_out.py; docs/sweeps.md)."""

from dataclasses import replace

import pytest

from hybrid.planning.cost import layout_studies as studies
from hybrid.planning.cost.devices import load_device
from hybrid.planning.cost.held_out import (
    MT_NLG_2022, held_out_rows, llama3_405b_choice, llama3_405b_config, other_rows,
)
from hybrid.planning.cost.steptime import predict_step
from hybrid.planning.job import plan_job


def falling(values: list[float]) -> bool:
    return all(a > b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("batch", [32, 128])
def test_tensor_vs_pipeline_peaks_at_the_nodes_eight_gpus(batch):
    """Figure 13 (161B on 64 GPUs): the peak at t = 8, falling away on both sides."""
    by_tp = studies.tensor_vs_pipeline(batch)
    peak = max(range(len(by_tp)), key=lambda i: by_tp[i][1])
    assert by_tp[peak][0] == 8
    assert falling([t for _, t in by_tp[peak:]]) and falling([t for _, t in by_tp[:peak + 1]][::-1])


@pytest.mark.parametrize("batch", [32, 128, 512])
def test_pipeline_vs_data_and_tensor_vs_data_fall_as_the_split_grows(batch):
    """Figures 14 and 15 (5.9B on 64 GPUs): deeper pipelines, and wider TP, are slower."""
    assert falling([t for _, t in studies.pipeline_vs_data(batch)])
    assert falling([t for _, t in studies.tensor_vs_data(batch)])


def test_the_best_micro_batch_of_the_91b_model_is_two():
    """Figure 16: the paper's best is 2. At batch 512 the model's is 2; at batch 128 its best
    is 1, ahead of 2 by less than 1% (a near tie the test states rather than hides)."""
    large = dict(studies.micro_batch_sizes(512))
    assert max(large, key=large.get) == 2
    small = dict(studies.micro_batch_sizes(128))
    assert small[2] >= 0.99 * max(small.values()) and small[2] > small[4] > small[8]


def test_interleaving_wins_at_every_batch_and_by_less_as_it_grows():
    """Figure 12 (175B on 96 GPUs, t 8 x p 12)."""
    gains = []
    for batch in (12, 24, 36, 48, 60):
        plain, interleaved = studies.interleaved_vs_not(batch)
        assert interleaved > plain
        gains.append(interleaved / plain)
    assert falling(gains)


def test_a_deeper_pipeline_of_a_growing_model_loses_less_at_a_larger_batch():
    """Figure 11 (weak scaling, 3 layers a stage at t = 8): throughput falls as the pipeline
    deepens, and at batch 128 keeps more of it than at batch 8."""
    kept = {}
    for batch in (8, 128):
        by_pp = [t for _, t in studies.pipeline_weak_scaling(batch)]
        assert falling(by_pp)
        kept[batch] = by_pp[-1] / by_pp[0]  # p = 8 against p = 1
    assert kept[128] > kept[8] + 0.2


def test_scattering_pipeline_messages_over_the_nics_wins_by_up_to_about_11_percent():
    """Figure 18 (175B, t 8 x p 12, interleaved): faster at every batch from 12 to 60, by a
    gain that does not shrink as the batch grows (the paper: up to 11%)."""
    gains = []
    for batch in (12, 24, 36, 48, 60):
        whole, scattered = studies.scatter_gather(batch)
        gains.append(scattered / whole - 1)
    assert all(0.03 < gain < 0.13 for gain in gains)
    assert all(b >= a for a, b in zip(gains, gains[1:]))


@pytest.mark.slow  # prices every split of ten published runs (~10 s)
def test_table_1_splits_and_throughputs_as_far_as_first_principles_carry():
    """The issue asks for 8 of 10 on both: the published split among the model's 3 best, and
    the throughput at it within 15% (2 and 9 before #42, 8 and 7 after its third pass;
    docs/sweeps.md says which and why)."""
    rows = held_out_rows()
    assert sum(1 for r in rows if r["rank"] <= 3) >= 8
    assert sum(1 for r in rows if abs(r["error"]) <= 0.15) >= 8
    assert all(r["error"] > -0.05 for r in rows)  # optimistic, never much slower


def test_other_published_runs_are_reported_apart_and_fitted_to_nothing():
    """MT-NLG 530B at three sizes (Smith et al. 2022): in no fit; the model is faster than
    published, within 27% (DeepSpeed's engine priced from its code, whose 16-bit gradient
    accumulation makes it faster still: tests/test_pipe_engine.py), and its time falls with
    the GPUs as the published one does."""
    rows = other_rows(MT_NLG_2022)
    assert len(rows) == 3 and all(-0.27 < r["error"] < 0 for r in rows)
    assert falling([r["predicted_s"] for r in rows]) and falling([r["published_s"] for r in rows])


@pytest.mark.slow  # two searches of 8,192 devices (~10 s)
def test_the_search_picks_llama_3s_split_among_the_schedules_meta_ran():
    """Llama 3 405B on 8,192 H100s (Dubey et al. 2024, Table 4): among 1F1B and interleaved
    layouts the search's best is the published TP 8 x PP 16 x DP 64 without context
    parallelism; with the schedules Meta's stack did not run, it prefers DualPipeV on a
    deeper pipeline (TP 8 x PP 32), and says by how much (14.4 s against 12.5 s). Its lead
    over the best ZB-H1 (13.3 s) is the two-stream overlap of a pair's F and B that the cost
    model prices on a GPU (TP collectives hidden under the other part's compute): with the
    pairs' parts run in order, as hybrid's runtime runs them, the same layout is slower
    than that ZB-H1 (docs/sweeps.md)."""
    best, meta = llama3_405b_choice()
    chosen = meta["settings"]
    assert (chosen["tp"], chosen["pp"], chosen["dp"], chosen["cp"]) == (8, 16, 64, 1)
    assert chosen["schedule"] == "interleaved-1f1b"
    assert best["settings"]["schedule"] == "dualpipev"
    assert (best["settings"]["tp"], best["settings"]["pp"]) == (8, 32)
    assert 1.1 < meta["predicted"]["step_time_s"] / best["predicted"]["step_time_s"] < 1.2
    zb_h1, _ = llama3_405b_choice(top=1, schedules=("zb-h1",))
    assert (best["predicted"]["step_time_s"] < zb_h1["predicted"]["step_time_s"]
            < meta["predicted"]["step_time_s"])
    assert priced_with_pairs_in_order(best["settings"]) > zb_h1["predicted"]["step_time_s"]


def priced_with_pairs_in_order(settings: dict) -> float:
    """The step time of a searched layout of Llama 3 405B with each composite's parts run
    one after the other (``Device.host``: the one thing it changes in a GPU's pricing)."""
    cfg = llama3_405b_config()
    layout = {k: settings[k] for k in ("dp", "cp", "tp", "pp", "vpp", "schedule", "zero",
                                       "sequence_parallel")}
    cfg = replace(cfg, parallel=replace(cfg.parallel, **layout),
                  train=replace(cfg.train, micro_batch=settings["micro_batch"]),
                  model=replace(cfg.model, recompute=settings["recompute"]))
    in_order = replace(load_device("h100-80gb"), host=True)
    return predict_step(plan_job(cfg, lower=False), in_order).step_time_s
