"""Published training runs the cost model is checked against (pure: no torch).

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
GPT models of 22B to 1T parameters on A100-80GB (their Table 3: heads, hidden, layers,
tensor- and pipeline-parallel sizes, GPUs, global batch; sequence 2048, vocabulary 51200,
micro-batch 1, bf16), and their Table 5: seconds per iteration with full recompute (tensor
parallelism alone), and with sequence parallelism plus selective recompute ("present work").
The pipeline runs the non-interleaved 1F1B schedule and the embeddings are tied. The A100
preset's compute fraction (80% of the peak) was once fitted to these eight iteration times;
it now stands on published GEMM benchmarks (``devices.ACHIEVED_COMPUTE``), and its width
penalty is gone, replaced by the first-principles terms of ``memory_bound``.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Table 1: GPT models of 1.7B to 1T parameters on up to 3072 A100-80GB (heads,
hidden, layers, tensor- and pipeline-parallel sizes, GPUs, global batch, achieved TFLOP/s per
GPU; sequence 2048, vocabulary 51200, full activation recomputation, and their FLOP count
(Eq. 3) counts the recomputed forward). These were not used in the fit: they are the held-out
check (``held_out_rows``). The table gives no micro-batch size or schedule; Megatron-LM's
``examples/sc21/run_table_1.sh`` does, and how each run reduced its gradients: the published
layout is priced as it ran, and every other split at the best of what the paper's software
could run (1F1B, or the interleaved schedule with up to 4 chunks, micro-batch 1-16; no
sequence parallelism, no ZeRO).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybrid.planning.config import Config, ModelConfig, TrainConfig


@dataclass(frozen=True)
class GptRun:
    """A published GPT run's model and layout (sequence 2048, vocabulary 51200)."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int


@dataclass(frozen=True)
class PublishedRun(GptRun):
    """One run of Korthikanti et al. 2022 with its seconds per iteration."""

    full_recompute_s: float
    selective_sp_s: float

    def config(self, recompute: str) -> Config:
        """The run as hybrid would plan it, with ``recompute`` full (no sequence parallelism)
        or selective (with it)."""
        return a100_gpt(self, recompute, self.tp, self.pp,
                        sequence_parallel=recompute == "selective")


def a100_gpt(run: GptRun, recompute: str, tp: int, pp: int, sequence_parallel: bool = False) -> Config:
    """A published GPT run as hybrid plans it on the A100 preset: sequence 2048, vocabulary 51200, tied embeddings, bf16,
    micro-batch 1, ``tp`` x ``pp`` and the rest data parallel."""
    model = ModelConfig(name=run.name, layers=run.layers, hidden=run.hidden, heads=run.heads,
                        vocab=51200, vocab_pad_multiple=128, seq_len=2048, tie_embeddings=True,
                        recompute=recompute)
    cfg = Config(model=model, train=TrainConfig(global_batch=run.global_batch, micro_batch=1,
                                                precision="bf16"))
    cfg.parallel = replace(cfg.parallel, dp=run.gpus // (tp * pp), tp=tp, pp=pp,
                           sequence_parallel=sequence_parallel)
    cfg.cost = replace(cfg.cost, device="a100-80gb")
    return cfg


MIXED_PRECISION_STEP_BYTES = 44
"""Bytes per parameter Megatron-LM's mixed-precision optimizer step moves
(``Float16OptimizerWithFloat16Params.step``): the 16-bit gradients copied to 32-bit main
gradients (read 2, write 4), their norm for clipping (read 4), Adam on the main weights (read
weight, gradient and two moments, write three: 28) and the main weights copied back to the
16-bit model (read 4, write 2); hybrid's own step is Adam's 28 alone."""
TORCH_DDP_BYTES = 12
"""PyTorch's DDP (``--DDP-impl torch``; ``gradient_as_bucket_view`` off, its default) copies
each 16-bit gradient into its bucket, divides the bucket by the group's size before the
all-reduce and copies it back after: three read-write passes of 2 bytes."""
LOCAL_DDP_BYTES = 6
"""Megatron-LM's ``local`` DDP zeroes its 16-bit gradient buffer every step (write 2) and
divides it by the group's size before the all-reduce (read, write: 4)."""


FP16_UNSCALE_BYTES = 8
"""With ``--fp16`` (the 2021 scripts' setting, a constant loss scale of 8192) the step also
unscales the 32-bit main gradients and checks them for overflow in one pass (read, write:
``_unscale_main_grads_and_check_for_nan``); bf16 runs have no loss scale."""


def megatron_lm(device, torch_ddp: bool = False, fp16: bool = False):
    """``device`` running the software these runs used: Megatron-LM writes the attention
    scores out (its fused scale-mask-softmax, then dropout: Korthikanti et al.'s selective
    recompute exists to drop them), where hybrid's own layer runs a fused attention kernel;
    its pipeline ranks wait for every exchange, which it scatters over the nodes' NICs and
    gathers over NVLink (Narayanan et al. 2021, section 4.1); its optimizer step moves
    ``MIXED_PRECISION_STEP_BYTES`` a parameter (``FP16_UNSCALE_BYTES`` more with ``fp16``)
    and its DDP ``TORCH_DDP_BYTES`` (PyTorch's, ``torch_ddp``: reducing during the backward,
    in buckets) or ``LOCAL_DDP_BYTES`` (its own ``local`` DDP: one all-reduce of its
    contiguous buffer after the last backward), at the memory bandwidth."""
    step = (MIXED_PRECISION_STEP_BYTES + (FP16_UNSCALE_BYTES if fp16 else 0)
            + (TORCH_DDP_BYTES if torch_ddp else LOCAL_DDP_BYTES))
    return replace(device, unfused_attention=True, blocking_p2p=True, p2p_scatter_gather=True,
                   optimizer_s_per_param=step / device.memory_bandwidth,
                   dp_after_backward=not torch_ddp, dp_one_collective=not torch_ddp)


KORTHIKANTI_2022 = (
    PublishedRun("22B", 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10),
    PublishedRun("175B", 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75),
    PublishedRun("530B", 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83),
    PublishedRun("1T", 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49),
)


def compare_with_published(simulated: bool = True) -> list[dict]:
    """One row per run and recompute mode: published and predicted seconds per iteration."""
    from hybrid.planning.cost.devices import load_device
    from hybrid.planning.job import plan_job
    from hybrid.planning.cost.steptime import predict_step

    rows = []
    for run in KORTHIKANTI_2022:
        for recompute, published in (("full", run.full_recompute_s),
                                     ("selective", run.selective_sp_s)):
            cfg = run.config(recompute)
            predicted = predict_step(plan_job(cfg, simulated=simulated, lower=False),
                                     megatron_lm(load_device(cfg.cost.device)),
                                     simulated=simulated)
            rows.append({"run": run.name, "recompute": recompute, "published_s": published,
                         "predicted_s": predicted.step_time_s,
                         "error": predicted.step_time_s / published - 1})
    return rows


@dataclass(frozen=True)
class ThroughputRun(GptRun):
    """One row of Narayanan et al. 2021's Table 1, with the micro-batch and the model chunks
    per pipeline rank it ran (Megatron-LM's ``examples/sc21/run_table_1.sh``)."""

    tflops_per_gpu: float
    micro_batch: int = 1
    vpp: int = 1
    local_ddp: bool = False
    """Gradients reduced after the last backward (the script's ``DDP=local``), else by
    PyTorch's DDP during it."""

    def config(self, tp: int | None = None, pp: int | None = None) -> Config:
        """The run as hybrid plans it (another ``tp``/``pp`` on the same GPUs for a ranking):
        full recompute, as the paper ran, its gradients reduced in 16 bits; at the published
        split, its micro-batch and schedule."""
        cfg = a100_gpt(self, "full", tp or self.tp, pp or self.pp)
        if cfg.parallel.dp > 1:
            cfg.parallel = replace(cfg.parallel, dp_compress="bf16")
        if (cfg.parallel.tp, cfg.parallel.pp) == (self.tp, self.pp):
            cfg.train = replace(cfg.train, micro_batch=self.micro_batch)
            cfg.parallel = replace(cfg.parallel, vpp=self.vpp, schedule=(
                "interleaved-1f1b" if self.vpp > 1 else "1f1b"))
        return cfg


NARAYANAN_2021 = (
    ThroughputRun("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16),
    ThroughputRun("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16),
    ThroughputRun("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16),
    ThroughputRun("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8),
    ThroughputRun("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1, local_ddp=True),
    ThroughputRun("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3, local_ddp=True),
    ThroughputRun("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2, local_ddp=True),
    ThroughputRun("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2, local_ddp=True),
    ThroughputRun("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3, local_ddp=True),
    ThroughputRun("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1, local_ddp=True),
)
