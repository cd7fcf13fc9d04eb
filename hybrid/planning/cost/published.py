"""Published training runs the cost model is checked against (pure: no torch).

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
GPT models of 22B to 1T parameters on A100-80GB (their Table 3: heads, hidden, layers,
tensor- and pipeline-parallel sizes, GPUs, global batch; sequence 2048, vocabulary 51200,
micro-batch 1, bf16), and their Table 5: seconds per iteration with full recompute (tensor
parallelism alone), and with sequence parallelism plus selective recompute ("present work").
The pipeline runs the non-interleaved 1F1B schedule and the embeddings are tied.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybrid.planning.config import Config, ModelConfig, TrainConfig


@dataclass(frozen=True)
class PublishedRun:
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    full_recompute_s: float
    selective_sp_s: float

    def config(self, recompute: str) -> Config:
        """The run as hybrid would plan it, with ``recompute`` full (no sequence parallelism)
        or selective (with it)."""
        model = ModelConfig(name=self.name, layers=self.layers, hidden=self.hidden,
                            heads=self.heads, vocab=51200, vocab_pad_multiple=128, seq_len=2048,
                            tie_embeddings=True, recompute=recompute)
        cfg = Config(model=model, train=TrainConfig(global_batch=self.global_batch,
                                                    micro_batch=1, precision="bf16"))
        cfg.parallel = replace(cfg.parallel, dp=self.gpus // (self.tp * self.pp), tp=self.tp,
                               pp=self.pp, sequence_parallel=recompute == "selective")
        cfg.cost = replace(cfg.cost, device="a100-80gb")
        return cfg


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
            predicted = predict_step(plan_job(cfg, simulated=simulated),
                                     load_device(cfg.cost.device), simulated=simulated)
            rows.append({"run": run.name, "recompute": recompute, "published_s": published,
                         "predicted_s": predicted.step_time_s,
                         "error": predicted.step_time_s / published - 1})
    return rows
