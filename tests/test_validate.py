"""validate_config: every bad config is one actionable line, raised before anything starts."""

import dataclasses

import pytest

from hybrid.planning.config import (
    Config, LauncherConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig,
)
from hybrid.planning.layout import LayoutError
from hybrid.planning.validate import microbatches, validate_config


def make(parallel=None, model=None, train=None, launcher=None, optim=None) -> Config:
    return Config(
        parallel=ParallelConfig(**{"dp": 2, "tp": 2, "pp": 2, **(parallel or {})}),
        model=ModelConfig(**{"layers": 4, "hidden": 64, "heads": 4, **(model or {})}),
        train=TrainConfig(**{"global_batch": 16, "micro_batch": 2, **(train or {})}),
        launcher=LauncherConfig(**(launcher or {})),
        optim=OptimConfig(**(optim or {})),
    )


def test_a_good_config_returns_its_layout():
    layout = validate_config(make())
    assert (layout.dp, layout.tp, layout.pp, layout.world_size) == (2, 2, 2, 8)
    assert microbatches(make()) == 4


BAD = [
    ({"parallel": {"tp": 3}}, "parallel.tp=3 does not divide model.heads=4; choose tp in {1, 2, 4}"),
    ({"parallel": {"tp": 8}, "model": {"heads": 8, "hidden": 64, "ffn_hidden": 100}},
     "parallel.tp=8 does not divide model.ffn_hidden=100"),
    ({"parallel": {"tp": 2}, "model": {"vocab": 255, "vocab_pad_multiple": 1}},
     "parallel.tp=2 does not divide the padded vocabulary 255"),
    ({"model": {"heads": 5}}, "model.heads=5 does not divide model.hidden=64"),
    ({"parallel": {"pp": 4, "vpp": 2, "schedule": "interleaved-1f1b"}},
     "parallel.pp=4 x parallel.vpp=2 = 8 stages exceeds model.layers=4"),
    ({"parallel": {"pp": 8}, "train": {"global_batch": 32}},
     "parallel.pp=8 x parallel.vpp=1 = 8 stages exceeds model.layers=4"),
    ({"train": {"global_batch": 15}},
     "train.global_batch=15 is not divisible by parallel.dp=2 x train.micro_batch=2 = 4"),
    ({"parallel": {"pp": 4, "vpp": 1, "schedule": "interleaved-1f1b"}},
     "parallel.schedule=interleaved-1f1b needs parallel.vpp >= 2"),
    ({"parallel": {"vpp": 2}}, "parallel.vpp=2 needs parallel.schedule=interleaved-1f1b"),
    ({"parallel": {"pp": 2, "vpp": 1, "dp": 1, "schedule": "zb-v"}},
     "parallel.schedule=zb-v runs exactly 2 chunks per rank, got parallel.vpp=1; set "
     "parallel.vpp=2"),
    ({"parallel": {"pp": 2, "vpp": 2, "dp": 1, "schedule": "zb-v"}, "train": {"device": "cuda"}},
     "parallel.schedule=zb-v runs on train.device=cpu only"),
    ({"parallel": {"pp": 4, "vpp": 1, "dp": 1, "schedule": "interleaved-1f1b"},
      "model": {"layers": 8}}, "needs parallel.vpp >= 2"),
    ({"parallel": {"pp": 2, "vpp": 2, "dp": 1, "schedule": "interleaved-1f1b"},
      "train": {"global_batch": 6}},
     "needs micro-batches per step (3 = global_batch 6 / (dp 1 x micro_batch 2)) "
     "to be a multiple of parallel.pp=2"),
    ({"parallel": {"schedule": "1f2b"}}, "parallel.schedule='1f2b' is unknown; choose one of "
                                         "gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v"),
    ({"parallel": {"order": "tp-pp"}}, "parallel.order='tp-pp' is not a permutation"),
    ({"parallel": {"dp": 0}}, "parallel.dp=0 must be an integer >= 1"),
    ({"parallel": {"zero": 4}}, "parallel.zero=4 is unknown; choose one of 0, 1, 2, 3"),
    ({"parallel": {"sequence_parallel": True}, "model": {"seq_len": 33}},
     "parallel.sequence_parallel=true needs model.seq_len=33 divisible by parallel.tp=2"),
    ({"train": {"precision": "fp16"}}, "train.precision='fp16' is unknown"),
    ({"train": {"micro_batch": 0}}, "train.micro_batch=0 must be an integer >= 1"),
    ({"launcher": {"nproc_per_node": 4}}, "parallel.dp*tp*pp = 2*2*2 = 8 but the launcher "
                                          "starts 4 processes"),
    ({"launcher": {"nnodes": 3}}, "cannot be spread evenly over launcher.nnodes=3"),
    ({"parallel": {"partition": "greedy"}}, "parallel.partition='greedy' is unknown"),
    ({"optim": {"implementation": "apex"}}, "optim.implementation='apex' is unknown"),
    ({"parallel": {"partition_file": "costs.json"}},
     "parallel.partition_file is set but parallel.partition=uniform ignores it; set "
     "parallel.partition=measured"),
    ({"parallel": {"partition": "measured", "block_costs": [1.0, 2.0]}},
     "parallel.block_costs has 2 values, needs 6 finite seconds >= 0"),
    ({"parallel": {"partition": "measured", "block_costs": [1.0] * 5 + [float("nan")]}},
     "parallel.block_costs has 6 values, needs 6 finite seconds >= 0"),
    ({"launcher": {"name": "torchrun", "nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}},
     "launcher.node_rank=2 must be in 0..1 for launcher.nnodes=2"),
    ({"launcher": {"name": "torchrun", "nnodes": 2, "rdzv_endpoint": "node0"}},
     "launcher.rdzv_endpoint=node0 is not HOST:PORT"),
    ({"launcher": {"name": "torchrun", "nnodes": 2, "rdzv_endpoint": "node0:99999"}},
     "launcher.rdzv_endpoint=node0:99999 is not HOST:PORT"),
    ({"launcher": {"name": "torchrun", "nnodes": 2, "rdzv_endpoint": "h:1",
                   "rdzv_timeout_s": 0}}, "launcher.rdzv_timeout_s=0 must be a finite number"),
    ({"launcher": {"name": "torchrun", "nnodes": 2, "nproc_per_node": 2,
                   "rdzv_endpoint": "h:1"}}, "but the launcher starts 4 processes"),
    ({"parallel": {"dp_sync_every": 4}, "train": {"steps": 10}},
     "train.steps=10 is not a multiple of parallel.dp_sync_every=4: the run would end with "
     "replicas that disagree; set train.steps=12"),
    ({"parallel": {"dp_compress": "powersgd", "zero": 1}},
     "parallel.dp_compress=powersgd needs unsharded optimizer state: set parallel.zero=0"),
    ({"parallel": {"cp": 3}, "model": {"seq_len": 64}},
     "parallel.cp=3 needs model.seq_len=64 divisible by 2*cp=6 (each rank holds two of 2*cp "
     "equal chunks); use cp in {1, 2}"),
    ({"parallel": {"cp": 2, "tp": 4, "sequence_parallel": True}, "model": {"seq_len": 12}},
     "parallel.sequence_parallel=true with parallel.cp=2 needs each rank's 6 tokens divisible "
     "by parallel.tp=4"),
    ({"parallel": {"cp": 2, "dp_sync_every": 2}, "train": {"steps": 10}},
     "the ranks of a context group hold parts of the same sequences and must step together"),
    ({"parallel": {"cp_comm": "ring"}}, "parallel.cp_comm='ring' is not one of p2p, allgather"),
    ({"parallel": {"cp": 2, "order": "tp-dp-pp"}},
     "parallel.order='tp-dp-pp' is not a permutation of tp-cp-dp-pp (cp > 1 must be placed)"),
    ({"parallel": {"cp": 2}, "launcher": {"nproc_per_node": 8}},
     "parallel.dp*cp*tp*pp = 2*2*2*2 = 16 but the launcher starts 8 processes"),
]


@pytest.mark.parametrize("overrides, expected", BAD, ids=[e[:40] for _, e in BAD])
def test_bad_configs_raise_one_line_with_the_fix(overrides, expected):
    with pytest.raises(LayoutError) as err:
        validate_config(make(**overrides))
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


def test_measured_partition_is_a_valid_choice_with_or_without_costs():
    validate_config(make({"partition": "measured"}))
    validate_config(make({"partition": "measured", "partition_file": "x.json",
                          "block_costs": [0.0, 1.0, 1.0, 1.0, 1.0, 5.0]}))


def test_messages_say_what_to_change():
    with pytest.raises(LayoutError, match="use global_batch in {4, 8, 12, 16, ...}"):
        validate_config(make(train={"global_batch": 6}))


def test_config_dataclasses_are_keyword_only_and_documented():
    with pytest.raises(TypeError):
        ParallelConfig(2, 2, 2)  # noqa: positional use would silently swap axes
    import inspect

    for cls in (ParallelConfig, ModelConfig, TrainConfig):
        text = inspect.getsource(cls)  # its own module's (ModelConfig: model_config.py)
        for f in dataclasses.fields(cls):
            block = text.split(f"    {f.name}:", 1)[1].split("\n", 2)[1]
            assert '"""' in block, f"{cls.__name__}.{f.name} has no docstring"


@pytest.mark.parametrize("launcher, expected", [
    ({"name": "torchrun", "nnodes": 2, "rdzv_endpoint": "h:1"}, None),
    ({"name": "torchrun", "nnodes": 2}, "launcher.nnodes=2 needs launcher.rdzv_endpoint=HOST:PORT"),
    ({"name": "slurm", "nnodes": 2, "rdzv_endpoint": "h:1"},
     "launcher=slurm places the nodes itself"),
    ({"name": "local", "nnodes": 2}, "launcher=local runs one node, not launcher.nnodes=2"),
    ({"name": "mpirun"}, "launcher.name='mpirun' is unknown; choose one of local, torchrun, slurm"),
])
def test_each_launcher_words_its_own_rules(launcher, expected):
    from launch.launchers.registered import launcher_problem

    cfg = make(launcher=launcher)
    validate_config(cfg)  # the layout's rules hold: what is left is the launcher's
    assert launcher_problem(cfg) == expected if expected is None else \
        expected in launcher_problem(cfg)


def test_the_launchers_are_named_in_one_order_whichever_registered_first():
    """Importing ``launch.launchers.slurm`` before the others registers it first; the
    message still names the built-in launchers in their order (#43: it did not)."""
    from launch.launchers.launcher import LAUNCHERS
    from launch.launchers.registered import launcher_problem

    saved = dict(LAUNCHERS)
    try:
        LAUNCHERS.clear()
        LAUNCHERS.update(reversed(list(saved.items())))
        assert launcher_problem(make(launcher={"name": "mpirun"})).endswith(
            "choose one of local, torchrun, slurm")
    finally:
        LAUNCHERS.clear()
        LAUNCHERS.update(saved)


def test_torchrun_checkpoints_on_several_nodes_need_one_shared_directory():
    from launch.launchers.registered import launcher_problem

    cfg = make(launcher={"name": "torchrun", "nnodes": 2, "rdzv_endpoint": "h:1"})
    cfg.checkpoint.every = 5
    assert "set checkpoint.dir to one path that all nodes share" in launcher_problem(cfg)
    cfg.checkpoint.dir = "/shared/ckpt"
    assert launcher_problem(cfg) is None


@pytest.mark.parametrize("every,moments,expected", [
    (5, False, "parallel.dp_sync_every=2 leaves each replica its own AdamW moments"),
    (5, True, "checkpoint.every=5 is not a multiple of parallel.dp_sync_every=2"),
])
def test_local_sgd_checkpoints_only_where_replicas_agree(every, moments, expected):
    cfg = make({"dp_sync_every": 2, "dp_sync_moments": moments}, train={"steps": 10})
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=every)
    with pytest.raises(LayoutError, match=expected):
        validate_config(cfg)
    cfg.checkpoint = dataclasses.replace(cfg.checkpoint, every=4)
    if moments:
        validate_config(cfg)
