"""The llama family: presets with the published shapes and parameter counts, its FLOPs, its
shape errors in one line before launch, and, through ``hybrid-train``, every layout's losses
equal to the 1-process run's (rtol 1e-4), state bytes as predicted."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hybrid.planning.config import ModelConfig
from hybrid.planning.cost.flops import layer_forward_flops
from hybrid.planning.cost.sizes import param_count
from hybrid.planning.params import model_param_specs
from hybrid.testing.accounting import checked_records

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(Path(sys.executable).parent / "hybrid-train")
STEPS = 6
COMMON = ["model=llama-tiny", "data=synthetic", f"train.steps={STEPS}", "train.global_batch=8",
          "train.micro_batch=2", "train.log_every=100", "train.timeline_step=0", "seed=11"]
TIED = ["model.tie_embeddings=true"]


def preset(name: str) -> ModelConfig:
    from tests.test_param_count import load_preset

    return load_preset(name)


@pytest.mark.parametrize("name, published", [
    # the parameter counts of the HF checkpoints (safetensors metadata)
    ("smollm-135m", 134_515_008), ("smollm-360m", 361_821_120),
    ("tinyllama-1.1b", 1_100_048_384), ("llama3.2-1b", 1_235_814_400),
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)])
def test_presets_count_the_published_parameters(name, published):
    cfg = preset(name)
    assert cfg.family == "llama"
    assert param_count(replace(cfg, vocab_pad_multiple=1)) == published


def test_llama_has_no_biases_no_position_table_and_rmsnorm_scales_only():
    names = list(model_param_specs(preset("llama-tiny")))
    assert not any(n.endswith(".bias") or "position" in n for n in names)
    assert "blocks.1.input_norm.weight" in names and "blocks.1.mlp.gate.weight" in names
    specs = model_param_specs(preset("llama-tiny"))
    # 4 query heads + 2 keys + 2 values, 8 wide each
    assert specs["blocks.1.attention.qkv.weight"].shape == (64, 32)


def test_layer_flops_are_twice_the_matmul_weights_per_token_plus_attention():
    cfg = preset("llama3-8b")
    h, f, s = cfg.hidden, cfg.ffn, cfg.seq_len
    matmul_weights = (h + 2 * 8 * 128) * h + h * h + 3 * h * f
    assert layer_forward_flops(cfg, 1) == 2 * s * matmul_weights + 4 * s * s * h


def run_train(run_dir: Path, *overrides: str, timeout: float = 500):
    return subprocess.run([TRAIN, *COMMON, f"hydra.run.dir={run_dir}", *overrides],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("overrides, needle", [
    (["model.kv_heads=3"], "model.kv_heads=3 does not divide model.heads=4; choose kv_heads "
                           "in {1, 2, 4}"),
    (["parallel=single", "parallel.tp=4"], "parallel.tp=4 does not divide model.kv_heads=2; "
                                           "choose tp in {1, 2}"),
    (["model.rope_base=0"], "model.rope_base=0.0 must be a finite number > 1"),
    (["model=tiny", "model.kv_heads=2"], "model.kv_heads=2 asks for grouped-query attention, "
                                         "which model.family=gpt2 has not"),
])
def test_bad_shapes_exit_2_with_one_line_before_launch(overrides, needle, tmp_path):
    done = run_train(tmp_path, *overrides, timeout=90)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert "Traceback" not in done.stderr and not (tmp_path / "config.json").exists()


LAYOUTS = {
    "tp2-sp-kv2": ["parallel=single", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "dp2-tp2-pp2-1f1b": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                         "parallel.schedule=1f1b"],
    # rotary angles from each rank's own zigzag positions
    "cp2-tp2": ["parallel=single", "parallel.cp=2", "parallel.tp=2"],
    "dp2-zero3-pp2-interleaved": ["parallel=single", "parallel.dp=2", "parallel.pp=2",
                                  "parallel.vpp=2", "parallel.schedule=interleaved-1f1b",
                                  "parallel.zero=3", "parallel.bucket_mb=0.02"],
}


TIED_LAYOUTS = {
    # V placement: rank 0 holds the embedding and the tied head
    "pp2-zb-v-tied": ["parallel=single", "parallel.pp=2", "parallel.vpp=2",
                      "parallel.schedule=zb-v"],
}

RESUME_SOURCE = "dp2-tp2-pp2-1f1b"
"""Also saves at step 3 (a save changes no training number): the resume test's source."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 1-process runs' losses, untied and tied (each made when first asked for)."""
    runs = {}

    def get(tied: bool) -> list[float]:
        if tied not in runs:
            run_dir = tmp_path_factory.mktemp(f"llama-reference-{tied}")
            done = run_train(run_dir, "parallel=single", *(TIED if tied else []))
            assert done.returncode == 0, done.stderr[-3000:]
            runs[tied] = [r["loss"] for r in checked_records(run_dir)]
        return runs[tied]
    return get


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """Each layout's run directory (each made when first asked for)."""
    runs = {}

    def get(name: str) -> Path:
        if name not in runs:
            run_dir = tmp_path_factory.mktemp(f"llama-{name}")
            tied = name in TIED_LAYOUTS
            overrides = TIED_LAYOUTS[name] + TIED if tied else LAYOUTS[name]
            saves = ["checkpoint.every=3"] if name == RESUME_SOURCE else []
            done = run_train(run_dir, *overrides, *saves)
            assert done.returncode == 0, done.stderr[-3000:]
            runs[name] = run_dir
        return runs[name]
    return get


def assert_same_losses(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference) == STEPS
    assert losses[0] == pytest.approx(reference[0], rel=1e-5)
    assert losses == pytest.approx(reference, rel=1e-4)
    assert reference[-1] < reference[0]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(LAYOUTS) + list(TIED_LAYOUTS))
def test_losses_equal_the_1_process_run(name, reference, layout_runs):
    losses = [r["loss"] for r in checked_records(layout_runs(name))]  # state bytes as predicted
    assert_same_losses(losses, reference(name in TIED_LAYOUTS))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_checkpoint_saved_on_2x2x2_resumes_on_tp2_with_sequence_parallelism(reference,
                                                                              layout_runs,
                                                                              tmp_path):
    step = layout_runs(RESUME_SOURCE) / "checkpoints" / "step_00000003"
    done = run_train(tmp_path, *LAYOUTS["tp2-sp-kv2"], f"checkpoint.resume_from={step}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout
    resumed = {r["step"]: r["loss"] for r in checked_records(tmp_path)}
    assert sorted(resumed) == [4, 5, 6]
    assert list(resumed.values()) == pytest.approx(reference(False)[3:], rel=1e-4)


@pytest.mark.slow
def test_hybrid_plan_searches_llama3_70b_on_64_h100s():
    import json

    done = subprocess.run([str(Path(sys.executable).parent / "hybrid-plan"), "model=llama3-70b",
                           "search.world=64", "cost.device=h100-80gb", "format=json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ranked = json.loads(done.stdout)["candidates"]
    assert len(ranked) == 10
    times = [c["predicted"]["step_time_s"] for c in ranked]
    assert times == sorted(times) and times[0] > 0
    for c in ranked:  # tp splits the 8 key/value groups; every layout fits an 80 GB device
        assert 8 % c["settings"]["tp"] == 0
        assert c["predicted"]["mem_bytes_per_rank"] < 80 * 2**30
