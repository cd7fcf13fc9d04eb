"""Narayanan et al. 2021's own layout studies (section 5), priced by the cost model (pure: no
torch): the layouts each figure compares, with the model shapes, batches and micro-batches of
Megatron-LM's ``examples/sc21/run_figure_*.sh``, and what the paper says of their order.
``tests/test_layout_studies.py`` checks that the model orders them as the paper does; no
figure was used to set any of the model's figures.
"""

from __future__ import annotations

from dataclasses import replace

from hybrid.planning.cost.devices import load_device
from hybrid.planning.cost.published import GptRun, a100_gpt, megatron_lm
from hybrid.planning.cost.steptime import predict_step
from hybrid.planning.job import plan_job

GPT_161B = GptRun("161B", 128, 20480, 32, 8, 8, 64, 128)
"""Figure 13: tensor against pipeline parallelism on 64 GPUs (32 layers, hidden 20480)."""
GPT_5_9B = GptRun("5.9B", 32, 3840, 32, 1, 2, 64, 128)
"""Figures 14 and 15: pipeline and tensor against data parallelism on 64 GPUs."""
GPT_91B = GptRun("91B", 128, 15360, 32, 8, 8, 64, 128)
"""Figure 16: micro-batch size at (t, p) = (8, 8) on 64 GPUs."""
GPT_175B = GptRun("175B", 96, 12288, 96, 8, 12, 96, 12)
"""Figure 12: interleaved (two layers a chunk: 4 chunks a rank) against 1F1B on 96 GPUs."""


def tflops(run: GptRun, tp: int, pp: int, batch: int, micro_batch: int = 1,
           vpp: int = 1, scatter_gather: bool = True) -> float:
    """The model's TFLOP/s per GPU (the paper's count) for ``run`` at this layout, as
    Megatron-LM ran it (``published.megatron_lm``, its ``local`` DDP as the figures' scripts
    set): full recompute, 16-bit gradients; ``scatter_gather=False``: the pipeline's messages
    sent whole between nodes (``--no-scatter-gather-tensors-in-pipeline``)."""
    cfg = a100_gpt(run, "full", tp, pp)
    cfg.train = replace(cfg.train, micro_batch=micro_batch, global_batch=batch)
    cfg.parallel = replace(cfg.parallel, vpp=vpp,
                           schedule="interleaved-1f1b" if vpp > 1 else "1f1b",
                           dp_compress="bf16" if cfg.parallel.dp > 1 else "none")
    device = replace(megatron_lm(load_device("a100-80gb"), fp16=True),
                     p2p_scatter_gather=scatter_gather)
    return predict_step(plan_job(cfg, simulated=False), device,
                        simulated=False).tflops_per_device


def tensor_vs_pipeline(batch: int) -> list[tuple[int, float]]:
    """Figure 13: (t, TFLOP/s) for t x p = 64, t from 32 down to 2. The paper: the peak is
    at t = 8, the GPUs of one node."""
    return [(tp, tflops(GPT_161B, tp, 64 // tp, batch)) for tp in (32, 16, 8, 4, 2)]


def pipeline_vs_data(batch: int) -> list[tuple[int, float]]:
    """Figure 14: (p, TFLOP/s) at t = 1, micro-batch 1. The paper: throughput falls as the
    pipeline deepens, for every batch size."""
    return [(pp, tflops(GPT_5_9B, 1, pp, batch)) for pp in (2, 4, 8, 16, 32)]


def tensor_vs_data(batch: int) -> list[tuple[int, float]]:
    """Figure 15: (t, TFLOP/s) at p = 1, micro-batch 1. The paper: throughput falls as t
    grows, for every batch size."""
    return [(tp, tflops(GPT_5_9B, tp, 1, batch)) for tp in (2, 4, 8, 16, 32)]


def micro_batch_sizes(batch: int) -> list[tuple[int, float]]:
    """Figure 16: (micro-batch, TFLOP/s). The paper: the best micro-batch is 2."""
    return [(mb, tflops(GPT_91B, 8, 8, batch, micro_batch=mb)) for mb in (1, 2, 4, 8)]


def interleaved_vs_not(batch: int) -> tuple[float, float]:
    """Figure 12: (1F1B, interleaved) TFLOP/s. The paper: interleaved is faster at every
    batch size from 12 to 60, by less as the batch grows."""
    return (tflops(GPT_175B, 8, 12, batch), tflops(GPT_175B, 8, 12, batch, vpp=4))


def pipeline_weak_scaling(batch: int) -> list[tuple[int, float]]:
    """Figure 11: (p, TFLOP/s) at t = 8, three layers a stage (the model grows with the
    pipeline), hidden 20480. The paper: throughput falls as p grows, and less at batch 128
    than at batch 8, the bubble spread over more micro-batches."""
    return [(pp, tflops(GptRun(f"weak-{pp}", 128, 20480, 3 * pp, 8, pp, 8 * pp, batch), 8, pp,
                        batch)) for pp in (1, 2, 4, 8)]


def scatter_gather(batch: int) -> tuple[float, float]:
    """Figure 18: (messages whole, scattered and gathered) TFLOP/s for the 175B model of
    Figure 12, interleaved. The paper: the optimisation is faster, by up to 11%, most where
    the schedule communicates most."""
    return (tflops(GPT_175B, 8, 12, batch, vpp=4, scatter_gather=False),
            tflops(GPT_175B, 8, 12, batch, vpp=4))
