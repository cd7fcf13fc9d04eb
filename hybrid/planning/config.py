"""The typed schema of ``conf/``: plain keyword-only dataclasses.

Defaults here equal what ``conf/`` ships (model ``tiny``, the main job's train and optim
settings), except the layout, which ``conf/base.yaml`` sets to DP 2 x TP 2 x PP 2 and the
model preset, which it sets to ``small``: ``docs/config.md`` shows the composed values.

The model (``model.*``) is in ``hybrid.planning.model_config``; where the run runs and what
it keeps (``launcher.*``, ``checkpoint.*``) in ``hybrid.planning.run_config``: both imported
here as ``Config``'s fields.

Hydra composes the YAML files into these (they are registered in its ConfigStore by
``launch/``), so a misspelt key or a wrong type fails at composition time. Everything inside
``hybrid/`` receives these dataclasses, never an OmegaConf ``DictConfig``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hybrid.planning.dp_config import DpStrategyConfig, flat_keys
from hybrid.planning.model_config import ModelConfig
from hybrid.planning.run_config import CheckpointConfig, LauncherConfig


# Upper bounds on the values the planner and the data builder grow with, checked before
# anything is built from them (``hybrid.planning.validate``): a typo (train.global_batch=1e12)
# is refused in one line instead of filling the launcher's memory with schedule actions or
# sample indices. Each is far beyond a real run, so no real setting meets one:
MAX_MICROBATCHES = 2**16
"""Micro-batches per optimizer step on one replica. Llama 3 405B ran 16 per replica (TP 8 x
PP 16 x DP 64); accumulating GPT-3's 1536-sequence batch on one device is 1536. A schedule
holds a few actions per micro-batch and stage, so this is the one that grows fastest."""
MAX_GLOBAL_BATCH = 2**24
"""Sequences per step: GPT-3 used 1536, Llama 3 405B 2048 (16M tokens at 8192 positions);
16,777,216 sequences is 8,000 times that."""
MAX_MICRO_BATCH = 2**16
"""Sequences per micro-batch on one replica (real runs: 1 to 32)."""
MAX_SEQ_LEN = 2**24
"""Positions per sequence: 16,777,216, beyond the longest published context (10M)."""
MAX_VOCAB = 2**24
"""Vocabulary entries: the largest published vocabularies hold about 256k, this 64 times it."""
MAX_STEPS = 10**8
"""Optimizer steps: at one step a second, three years."""
MAX_TRAIN_SAMPLES = 2**32
"""train.steps x train.global_batch: data=indexed builds a sample index this long (megatron's,
about 16 bytes a sample). Llama 3 405B's whole training is about 1.9e9 sequences; 2**32
(4.3e9) is twice that."""

@flat_keys
@dataclass(kw_only=True)
class ParallelConfig:
    dp: int = 1
    """Data-parallel size: replicas that see different data and average gradients."""
    tp: int = 1
    """Tensor-parallel size: each weight matrix is split across this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers are split into this many stages."""
    vpp: int = 1
    """Virtual stages (model chunks) per pipeline rank; > 1 needs schedule=interleaved-1f1b
    (any vpp >= 2), zb-v or dualpipev (exactly 2)."""
    cp: int = 1
    """Context-parallel size: each sequence is split over this many ranks (two of 2*cp chunks
    each, zigzag), attention passes keys and values around them; for long sequences."""
    ep: int = 1
    """Expert-parallel size (model.moe.experts > 0): the experts of each MoE layer are spread over
    this many ranks carved out of dp x cp (megatron's tp-cp-ep-dp-pp), tokens reach them by
    all-to-all; an expert's gradient is averaged over the dp*cp/ep ranks holding the same
    experts (docs/moe.md). Must divide dp*cp and model.moe.experts."""
    cp_comm: str = "p2p"
    """How attention's keys and values cross the context group: p2p (around the ring, block by
    block, behind each block's compute) | allgather (one all-gather of all of them)."""
    order: str = "tp-cp-dp-pp"
    """Rank order, fastest-varying axis first (Megatron's default: TP fastest, inside a node);
    cp may be left out while parallel.cp=1."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe | 1f1b | interleaved-1f1b | zb-h1 | zb-v | dualpipev (the last
    two: V placement, rank r holds stages r and 2*pp-1-r, so rank 0 computes the loss; gloo
    only; dualpipev needs >= 2*pp micro-batches)."""
    sequence_parallel: bool = False
    """Shard activations along the sequence between TP regions (Megatron's sequence parallel)."""
    partition: str = "uniform"
    """How blocks are split into stages: uniform (by layer count) | balanced (by parameters)
    | measured (by each block's forward + backward seconds, timed on the ranks before training
    or read from ``partition_file``; the largest stage is made as small as it can be)."""
    partition_file: Optional[str] = None
    """partition=measured: a file of measured block costs. If it exists (and was measured for
    the same model, micro-batch, precision, TP and device) it is read instead of measuring;
    else the ranks measure and write it. None: they measure and write RUN_DIR/block_costs.json."""
    block_costs: Optional[List[float]] = None
    """partition=measured: seconds of forward + backward per block (embedding, each layer,
    head), filled in from the measurement or partition_file; set by hand to pin a partition."""
    pp_balance: str = "static"
    """How the layers stay split over the pipeline stages: static (as partition says, all
    run) | dynamic (re-split by each stage's measured speed every pp_balance_every steps, at a
    step boundary; the losses stay the same: docs/pipeline.md)."""
    pp_balance_every: int = 5
    """pp_balance=dynamic: steps measured between two decisions of the split."""
    pp_balance_min_saving: float = 0.1
    """pp_balance=dynamic: a new split is taken only when predicted to save at least this
    share of the step (hysteresis: scheduling noise moves nothing)."""
    pp_balance_move: str = "memory"
    """pp_balance=dynamic: how a new split's state reaches its stages: memory (the moved
    layers' weights, optimizer and DP state sent between the pipeline's ranks) | checkpoint
    (every rank saves its state to disk and loads it back resharded; slower, the fallback)."""
    dp_strategy: DpStrategyConfig = field(default_factory=DpStrategyConfig)
    """The DP strategies' settings, one group each (``parallel/dp=zero3``, several at once:
    ``parallel/dp=[zero1,bf16]``; ``hybrid.planning.dp_config``). The flat keys of before
    (``parallel.zero``, ``parallel.dp_compress``, ...) still work: see below."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 120
    """Optimizer steps to run."""
    global_batch: int = 16
    """Sequences per optimizer step, summed over all DP replicas and micro-batches."""
    micro_batch: int = 2
    """Sequences per micro-batch on one DP replica."""
    precision: str = "fp32"
    """fp32 | bf16 (bf16 compute, fp32 master weights and gradient reduction)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    device: str = "auto"
    """auto (CUDA if available, else CPU) | cpu | cuda."""
    log_every: int = 10
    """Print a log line every this many steps."""
    timeline_step: int = 3
    """Record the pipeline timeline of this step (1-based); 0 disables it."""
    collective_timeout_s: float = 300.0
    """Seconds any collective, process-group set-up or pipeline receive may wait before the
    rank fails instead of hanging."""
    straggler_ratio: float = 1.5
    """Warn when a rank's compute is this many times its peers' median (the ranks holding the
    same pipeline stages), costing at least 10% of the step, in 9 of 12 steps; 0 turns the
    warning off."""
    skip_memory_check: bool = False
    """Launch even when the memory estimate per rank exceeds what the ranks can use."""
    overwrite: bool = False
    """Replace the run a run directory holds: once every check has passed, the old run's
    files (checkpoints, metrics, TensorBoard events, timelines, worker logs; a checkpoint.dir
    elsewhere: its step_*) are moved, not deleted, to .replaced-<time>/ there, and one line
    says where. Refused with checkpoint.resume_from=auto or a checkpoint of that same run.
    Without it such a directory is refused unless the run resumes there."""


@dataclass(kw_only=True)
class DataConfig:
    source: str = "synthetic"
    """synthetic (generated, learnable, needs no files) | tokens (a flat binary token file) |
    indexed (Megatron's ``PREFIX.bin``/``PREFIX.idx``, read with megatron-core's datasets)."""
    path: Optional[str] = None
    """source=tokens: the token file; source=indexed: the ``PREFIX`` of one data set (both
    made by ``hybrid-data``; indexed files may come from Megatron's preprocessing)."""
    dtype: str = "uint16"
    """Element type of the token file (source=tokens): uint16 | uint32. An indexed file
    records its own."""
    samples: int = 4096
    """Number of generated sequences (source=synthetic only; a token file has as many samples
    as its length gives)."""
    blend: Optional[List[Any]] = None
    """source=indexed: several data sets by weight in Megatron's syntax, ``[0.7, PREFIX_A,
    0.3, PREFIX_B]`` (weights are normalised); instead of ``path``."""
    split: List[float] = field(default_factory=lambda: [969.0, 30.0, 1.0])
    """source=indexed: train, validation and test parts of every data set, by document
    (Megatron's convention; normalised)."""
    cache_dir: Optional[str] = None
    """source=indexed: where megatron-core's sample-index caches go, built once before the
    ranks start, and a built-in corpus (``example``); None means ``<run dir>/data_cache`` for
    the indices and the user's cache (``$XDG_CACHE_HOME/hybrid``, else ``~/.cache/hybrid``)
    for the corpus. Never the data's own folder."""
    example: Optional[str] = None
    """source=indexed: a built-in corpus instead of files, tokenized once per machine into the
    user's cache (or ``cache_dir``): python-docs (CPython's documentation topics, which every
    Python carries: about 2,600 paragraphs of English, one document each, byte-level:
    vocabulary 256)."""


@dataclass(kw_only=True)
class EvalConfig:
    every: Optional[int] = None
    """Evaluate the validation loss after every N-th optimizer step (0 = never): the
    validation split of data=indexed, or data=synthetic's held-out sequences. Unset (null,
    the schema's default; data=python-docs sets 20): every 20 steps when the data has a
    validation split (data=indexed whose data.split has a validation part: Megatron-LM too
    evaluates whenever it has validation data), never otherwise."""
    batches: int = 4
    """Global batches (of train.global_batch samples) per evaluation: the same ones every
    time, so evaluations compare. At most what the validation data holds (an indexed
    validation split read once, data=synthetic's data.samples held-out walks), checked before
    launch."""
    at_end: Optional[bool] = None
    """Also evaluate after the last step (when it is not already an every-th step). Unset
    (null, the schema's default): when the run evaluates every N steps on a validation
    split."""


ADAMW_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
"""``optim.implementation``'s choices (torch.optim.AdamW's ``fused``/``foreach`` flags)."""


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adamw"
    """Only AdamW for now."""
    implementation: str = "fused"
    """fused (one kernel per step over all tensors; CPU and CUDA, torchtitan's default) |
    foreach (one kernel per op over all tensors) | for-loop (one op per tensor; torch's
    default on CPU, 3-5x the CPU time of fused on the small presets). The same update up to
    rounding."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay for matrices (not norms, biases or position tables)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay (0.95 as in GPT-3 and Megatron's GPT recipes)."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""


@dataclass(kw_only=True)
class CostConfig:
    device: str = "cpu"
    """What the cost model prices the job on: a preset (a100-80gb, h100-80gb, h200, cpu) or a
    JSON file of a Device's fields (hybrid/planning/cost/devices.py)."""
    gpus_per_node: int = 8
    """Ranks per node for the cost model's links, unless the launcher places the nodes
    (launcher.nnodes > 1 or launcher.nproc_per_node)."""
    inter_node_gbit: Optional[float] = None
    """The link between nodes in Gb/s instead of the device's (e.g. 10 for plain Ethernet):
    what-if pricing, e.g. of the DP options hybrid-plan compares."""
    software: str = "hybrid"
    """The training stack the prediction is for (hybrid/planning/cost/software.py): hybrid,
    megatron-lm-2021 or deepspeed-pipe; it sets what the step costs and what the search
    offers."""
    replica_speed: Optional[List[float]] = None
    """Each DP replica's compute speed relative to the device (e.g. [1, 0.5]: the second at
    half speed): hybrid-plan then predicts the step under even shares and under
    parallel.dp_balance=dynamic's; None: every replica at the device's speed."""
    node_devices: Optional[List[str]] = None
    """One device per node, each as cost.device takes it (e.g. [a100-80gb, h100-80gb]): a
    cluster of mixed devices. The nodes are launcher.nnodes when the launcher places them, else
    the ranks in nodes of cost.gpus_per_node; a shorter list whose length divides the nodes
    names consecutive equal groups of nodes. hybrid-plan splits the layers by each stage's
    device (a slower stage gets fewer), gives replicas of unequal speed
    parallel.dp_balance=dynamic's shares, and prices the step against each uniform cluster;
    None: every node is cost.device."""


@dataclass(kw_only=True)
class Config:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    seed: int = 1234
    """Seeds weights, data order and generated data: the same seed gives the same run on any
    layout."""


@dataclass(kw_only=True)
class SearchConfig:
    world: int = 0
    """Search every layout of this many devices for the model and global batch (0: plan the
    config as given)."""
    top: int = 10
    """How many of the best layouts to print."""
    run: bool = False
    """Then train each of them with hybrid-train, one after another, and write the sweep
    report (sweep.csv, sweep.md, sweep.png) of measured beside predicted."""
    dir: Optional[str] = None
    """Where search.run puts its runs and report; None means multirun/search-<time>."""
    keep: List[str] = field(default_factory=list)
    """Settings the search holds at the config's values, e.g. [model.recompute,parallel.zero]
    (any of parallel.dp, cp, tp, pp, vpp, ep, schedule, zero, sequence_parallel,
    train.micro_batch, model.recompute)."""
    schedules: Optional[List[str]] = None
    """The pipeline schedules the search may choose (None: every one the software runs)."""


@dataclass(kw_only=True)
class PlanConfig(Config):
    search: SearchConfig = field(default_factory=SearchConfig)
    format: str = "text"
    """Output of ``hybrid-plan``: text | json."""
    full: bool = False
    """Print every rank and group even above 64 ranks (text output; json is always full)."""
    out: Optional[str] = None
    """Also write the run directory's ``config.json`` and ``plan.json`` there, for a launcher
    of your own: ``torchrun --nproc-per-node N -m hybrid.worker DIR``."""

    def job(self) -> Config:
        """The job's config without ``hybrid-plan``'s own fields."""
        return Config(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Config)})


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict, cls: type = Config) -> Any:
    """Rebuild a (nested) config dataclass from ``to_dict`` output; unknown keys are errors."""
    types = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key in getattr(cls, "flat_keys_of_before", ()):  # a config.json of before
            kwargs[key] = value
            continue
        if key not in types:
            raise ValueError(f"unknown config key {cls.__name__}.{key}")
        nested = types[key]
        kwargs[key] = from_dict(value, nested) if dataclasses.is_dataclass(nested) else value
    return cls(**kwargs)
