"""The cost model on published runs no figure of it was fitted to (pure: no torch; #30, #42).

For each run of Narayanan et al. 2021's Table 1 (``published.NARAYANAN_2021``): the
throughput the model predicts for the published layout against the published one, in the
paper's own FLOP convention (Eq. 3: full recomputation, the recomputed forward counted, as
``StepPrediction.tflops_per_device`` counts it), and how the model ranks the published
tensor x pipeline split among every other split of the same GPUs, each at its best micro-batch
and schedule of the paper's software (``published`` says which) and fitting in memory, among
what that software accepts (``splits``, ``variants_2021``) and with its DDP
(``software_2021``). Where
the model's best split is within its own error of the published one, it cannot tell them
apart, and the table says so.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from dataclasses import dataclass
from typing import Iterator, Optional

from hybrid.planning.config import Config, ModelConfig, TrainConfig
from hybrid.planning.cost.devices import Device, load_device, with_inter_bandwidth
from hybrid.planning.cost.published import (
    KORTHIKANTI_2022, NARAYANAN_2021, GptRun, ThroughputRun, a100_gpt,
)
from hybrid.planning.cost.pipe_engine import BF16_ACCUMULATE_BYTES
from hybrid.planning.cost.software import DEEPSPEED_PIPE, MEGATRON_LM_2021, Software
from hybrid.planning.cost.steptime import StepPrediction, predict_step
from hybrid.planning.job import plan_job
from hybrid.planning.layout import LayoutError, valid_sizes

MICRO_BATCHES_2021 = (1, 2, 4, 8, 16)
STATE_BYTES_2021 = 20
"""Bytes per parameter Megatron-LM's 2021 mixed-precision optimizer holds at its step: fp16
weights and gradients, fp32 master weights, the fp32 gradients it copies for the step, and
Adam's two fp32 moments (hybrid keeps fp32 weights and gradients and the moments: 16)."""
MAX_CHUNKS_2021 = 4
FITTED_MODELS = {(r.hidden, r.layers) for r in KORTHIKANTI_2022}
"""The models of the runs the A100 preset is checked against, whose compute fraction was once
fitted to them (a held-out run of one of them is marked)."""


def variants_2021(cfg: Config) -> Iterator[Config]:
    """The micro-batches and schedules a 2021 Megatron-LM run could choose for ``cfg``: its
    interleaved schedule needs more than 2 stages, whole layers a chunk and micro-batches a
    multiple of the stages (its argument checks and ``get_forward_backward_func``)."""
    par = cfg.parallel
    per_rank = cfg.model.layers // par.pp
    schedules = [("1f1b", 1)] + ([("interleaved-1f1b", v) for v in
                                  range(2, MAX_CHUNKS_2021 + 1) if per_rank % v == 0]
                                 if par.pp > 2 else [])
    for schedule, vpp in schedules:
        for mb in MICRO_BATCHES_2021:
            micro = cfg.train.global_batch // (par.dp * mb)
            if vpp > 1 and micro % par.pp:
                continue
            yield replace(cfg, parallel=replace(par, schedule=schedule, vpp=vpp),
                          train=replace(cfg.train, micro_batch=mb))


def best_prediction(cfg: Config, device: Device, simulated: bool = True
                    ) -> Optional[StepPrediction]:
    """The fastest of ``cfg``'s 2021 variants that plan and fit in the device's memory
    (``simulated=False``: each priced with its closed-form bubble)."""
    best = None
    for variant in variants_2021(cfg):
        try:
            plan = plan_job(variant, simulated=False)
        except LayoutError:
            continue
        if not fits_2021(plan, device):
            continue
        predicted = predict_step(plan, device, simulated=simulated)
        if best is None or predicted.step_time_s < best.step_time_s:
            best = predicted
    return best


def fits_2021(plan, device: Device) -> bool:
    """Whether the plan's largest rank fits with the 2021 software's optimizer state
    (``STATE_BYTES_2021`` per parameter) in place of hybrid's."""
    return max(est.total_bytes - est.param_bytes - est.grad_bytes - est.optimizer_bytes
               + STATE_BYTES_2021 * est.params for est in plan.memory) <= device.memory_bytes


def splits(run: ThroughputRun, gpus_per_node: int = 8) -> list[tuple[int, int]]:
    """Every (tp, pp) of the run's GPUs with TP inside a node and the layers divisible by the
    stages (Megatron-LM 2021's ``ParallelTransformer`` asserts it: its stages are equal)."""
    return [(tp, pp) for tp in valid_sizes(gpus_per_node) if run.gpus % tp == 0
            for pp in valid_sizes(run.gpus // tp) if run.layers % pp == 0
            and run.heads % tp == 0 and run.global_batch % (run.gpus // (tp * pp)) == 0]


def software_2021(device: Device, pp: int) -> Device:
    """``device`` running Megatron-LM as ``run_table_1.sh`` ran it: the
    ``megatron-lm-2021`` profile (``software.MEGATRON_LM_2021``)."""
    return MEGATRON_LM_2021.device(device, pp)


def held_out_row(run: ThroughputRun, device: Device, error: float) -> dict:
    """The published run against the model: throughput, and the rank of its split."""
    published = predict_step(plan_job(run.config(), lower=False), software_2021(device, run.pp))  # as it ran
    ranked = []  # in closed form, the published split too, so that all compare alike
    for tp, pp in splits(run):
        predicted = best_prediction(run.config(tp, pp), software_2021(device, pp),
                                    simulated=False)
        if predicted is not None:
            ranked.append((predicted.step_time_s, tp, pp))
    ranked.sort()
    best_s, best_tp, best_pp = ranked[0]
    own = next(i for i, (_, tp, pp) in enumerate(ranked) if (tp, pp) == (run.tp, run.pp))
    return {"run": run.name, "gpus": run.gpus, "tp": run.tp, "pp": run.pp,
            "fitted_model": (run.hidden, run.layers) in FITTED_MODELS,
            "published_tflops": run.tflops_per_gpu,
            "predicted_tflops": published.tflops_per_device,
            "error": published.tflops_per_device / run.tflops_per_gpu - 1,
            "rank": own + 1, "splits": len(ranked), "best_tp": best_tp, "best_pp": best_pp,
            "gap": published.step_time_s / best_s - 1,
            "within_error": published.step_time_s / best_s - 1 <= error}


@functools.cache
def held_out_rows() -> tuple[dict, ...]:
    """One row per run of Narayanan et al. 2021's Table 1, on the ``a100-80gb`` preset; a
    split is within the model's error of the best when the gap is under the preset's
    ``error_fraction`` (the mean |error| of these very rows, ``tests/test_held_out.py``).
    Computed once a process (it prices some 600 layouts); the rows are not to be changed."""
    device = load_device("a100-80gb")
    return tuple(held_out_row(run, device, device.error_fraction) for run in NARAYANAN_2021)


@dataclass(frozen=True)
class IterationRun:
    """A published large run beyond Narayanan et al.'s table, with its seconds per iteration:
    in no fit, and not Table 1's software (``software`` says what differs)."""

    run: GptRun
    vocab: int
    seconds: float
    source: str
    micro_batch: int = 1
    nic_gbit: Optional[float] = None
    """Gb/s between nodes a GPU has (None: the preset's, Selene's 8 HDR NICs a node)."""
    bf16_optimizer: bool = False
    """DeepSpeed's ``BF16_Optimizer`` (2022): gradients accumulated into a 32-bit copy
    (``pipe_engine.BF16_ACCUMULATE_BYTES``) and reduced in 32 bits; else 16-bit ones."""
    partition: str = "uniform"


MT_NLG_2022 = tuple(
    IterationRun(GptRun(f"MT-NLG 530B, {gpus} GPUs", 128, 20480, 105, 8, 35, gpus, 1920),
                 50272, seconds, "Smith et al. 2022, section 2.4")
    for gpus, seconds in ((2240, 60.1), (2800, 50.2), (3360, 44.4)))
"""Megatron-Turing NLG 530B: tensor 8 x pipeline 35 on 280, 350 and 420 DGX A100 nodes,
global batch 1920, sequence 2048, micro-batch 1, on DeepSpeed's pipeline engine
(``cost.software=deepspeed-pipe``: ``pipe_engine`` prices what it does)."""

BLOOM_2022 = (IterationRun(
    GptRun("BLOOM 176B, 384 GPUs", 112, 14336, 70, 4, 12, 384, 2048), 250880, 104.70,
    "BigScience tr11-176B-ml: README.md (iteration 85376), tr11-176B-ml.slurm",
    micro_batch=2, nic_gbit=4 * 100 / 8, bf16_optimizer=True, partition="balanced"),)
"""BLOOM 176B as ``bigscience-workshop/bigscience``'s ``train/tr11-176B-ml`` gives it: TP 4 x
PP 12 x DP 8 on 48 nodes of 8 A100-80GB, micro-batch 2, global batch 2048, sequence 2048,
``--bf16`` with the ``BF16_Optimizer`` (``ZERO_STAGE=0``: its own ZeRO-1), full recompute
(``--checkpoint-activations``), the embedding counted as a layer in the split
(``--pp-partition-method 'type:transformer|embedding'``: here ``partition=balanced``); 4
Omni-Path links of 100 Gb/s a node; 104.70 s an iteration at global batch 2048 (the README's
log line at iteration 85376, 149.77 TFLOP/s by its own count). Held out: nothing was fitted
to it."""


def other_rows(runs: tuple = MT_NLG_2022 + BLOOM_2022,
               software: Software = DEEPSPEED_PIPE) -> list[dict]:
    """Each of ``runs`` priced as it ran (on ``software``, its network and optimizer):
    predicted against published seconds."""
    rows = []
    for other in runs:
        device = load_device("a100-80gb")
        if other.nic_gbit is not None:
            device = with_inter_bandwidth(device, other.nic_gbit)
        device = software.device(device, other.run.pp)
        if other.bf16_optimizer:
            device = replace(device, grad_accumulate_bytes=BF16_ACCUMULATE_BYTES)
        cfg = a100_gpt(other.run, "full", other.run.tp, other.run.pp)
        cfg.model = replace(cfg.model, vocab=other.vocab)
        cfg.train = replace(cfg.train, micro_batch=other.micro_batch)
        cfg.parallel = replace(cfg.parallel, partition=other.partition, **(
            dict(dp_compress="none", zero=1) if other.bf16_optimizer else  # its own ZeRO-1
            dict(dp_compress="bf16")))
        predicted = predict_step(plan_job(cfg, lower=False), device)
        rows.append({"run": other.run.name, "source": other.source,
                     "published_s": other.seconds, "predicted_s": predicted.step_time_s,
                     "error": predicted.step_time_s / other.seconds - 1})
    return rows


def format_other(rows: list[dict]) -> str:
    """The markdown table of ``other_rows`` that docs/sweeps.md shows."""
    lines = ["| run | source | published s | predicted s | error |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['run']} | {r['source']} | {r['published_s']:.1f} | "
              f"{r['predicted_s']:.1f} | {r['error']:+.0%} |" for r in rows]
    return "\n".join(lines)


def mean_abs_error(rows: list[dict]) -> float:
    return sum(abs(r["error"]) for r in rows) / len(rows)


def format_held_out(rows: list[dict]) -> str:
    """The markdown table docs/sweeps.md shows (``bench/published_runs.py`` prints it)."""
    lines = ["| run | GPUs | published t x p | TFLOP/s published | predicted | error "
             "| rank of t x p | model's best t x p | published is slower by |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        verdict = " (within error)" if r["within_error"] else ""
        mark = "*" if r["fitted_model"] else ""
        lines.append(f"| {r['run']}{mark} | {r['gpus']} | {r['tp']} x {r['pp']} | "
                     f"{r['published_tflops']:.0f} | {r['predicted_tflops']:.0f} | "
                     f"{r['error']:+.0%} | {r['rank']} of {r['splits']} | "
                     f"{r['best_tp']} x {r['best_pp']} | {r['gap']:.0%}{verdict} |")
    worst = max(rows, key=lambda r: abs(r["error"]))
    independent = [r for r in rows if not r["fitted_model"]]
    lines.append("\n\\* the same model and tensor x pipeline split as a run the preset is "
                 "checked against (Korthikanti et al.'s), at more data parallelism: not "
                 "independent.")
    lines.append(f"\nThroughput: mean |error| {mean_abs_error(rows):.0%} "
                 f"({mean_abs_error(independent):.0%} over the {len(independent)} other "
                 f"models), worst {worst['error']:+.0%} ({worst['run']}), within 15% in "
                 f"{sum(1 for r in rows if abs(r['error']) <= 0.15)} of {len(rows)} runs; the "
                 f"published split is among the model's 3 best in "
                 f"{sum(1 for r in rows if r['rank'] <= 3)} of {len(rows)}, first or within "
                 f"the model's error of its best in "
                 f"{sum(1 for r in rows if r['within_error'])}.")
    return "\n".join(lines)


LLAMA3_405B = ModelConfig(name="llama3-405b", family="llama", layers=126, hidden=16384,
                          heads=128, kv_heads=8, ffn_hidden=53248, vocab=128256,
                          vocab_pad_multiple=128, seq_len=8192, rope_base=500000.0)
"""Llama 3 405B as Dubey et al. 2024 ("The Llama 3 Herd of Models", Table 4) trained it at
8K tokens: 8,192 H100s at TP 8 x CP 1 x PP 16 x DP 64, 16M tokens a step (2,048 sequences),
an interleaved 1F1B schedule; in no fit, on the ``h100-80gb`` preset, which nothing checks."""
SCHEDULES_LLAMA3 = ("1f1b", "interleaved-1f1b")
"""The pipeline schedules Meta's stack ran (its own variant of the interleaved one); the
zero-bubble schedules hybrid also searches came after."""


def llama3_405b_config() -> Config:
    """Llama 3 405B's run as Dubey et al. give it: 2,048 sequences a step, bf16, planned for
    the ``h100-80gb`` preset (the layout fields are what the search sets)."""
    cfg = Config(model=LLAMA3_405B, train=TrainConfig(global_batch=2048, micro_batch=1,
                                                      precision="bf16"))
    cfg.cost = replace(cfg.cost, device="h100-80gb")
    return cfg


def llama3_405b_choice(top: int = 40, schedules: Optional[tuple[str, ...]] = None
                       ) -> tuple[dict, dict]:
    """(the search's best layout, its best among ``SCHEDULES_LLAMA3``) for Llama 3 405B on
    8,192 H100s, each a candidate of ``search.search`` (settings and predicted);
    ``schedules``: the search limited to those (``search.schedules``)."""
    from hybrid.planning.cost.search import search
    from hybrid.planning.cost.search_limits import search_limits

    cfg = llama3_405b_config()
    found = search(cfg, 8192, load_device("h100-80gb"), top=top,
                   limits=search_limits(cfg, schedules=schedules))["candidates"]
    return found[0], next((c for c in found if c["settings"]["schedule"] in SCHEDULES_LLAMA3),
                          None)
