"""What a new user's trial found wrong or misleading (issue 51), each through the real command,
refused or warned of before anything is built: a shape field typed against ``model.from_hf``'s
folder, a Llama 3 context past its trained positions, a token file too short to train, and the
wording of a missing generate source, an import of a hybrid run, and an indexed output."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.data import validate_data
from hybrid.interop.hf_source import typed_model_fields
from launch.commands.app import compose_train_config

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.timeout(120)

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=256,
             hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
             rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")


def run(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / name), *map(str, args)], capture_output=True, text=True,
                          timeout=100)


def errors(done: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    return [line for line in done.stderr.splitlines() if not line.startswith("warning: ")]


@pytest.fixture
def hf_llama(tmp_path) -> Path:
    """A 2-layer HF Llama folder as far as planning reads it: its config.json (the weights
    are not read before launch)."""
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_a_typed_shape_field_against_the_hf_folder_is_refused_in_one_line(hf_llama, tmp_path):
    done = run("hybrid-train", f"model.from_hf={hf_llama}", "model.layers=4",
               f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert errors(done) == [f"error: model.layers: the HF folder {hf_llama} has layers=2, the "
                            f"config layers=4; model.from_hf takes the shape from the folder's "
                            f"config.json: drop model.layers=... (model.seq_len, "
                            f"vocab_pad_multiple and recompute stay yours)"]
    assert not (tmp_path / "run" / "config.json").exists()


def test_the_presets_shape_and_the_users_own_fields_stay_allowed_with_from_hf(hf_llama):
    # model=small's 4 layers are replaced silently; seq_len and an equal layers are the user's
    done = run("hybrid-plan", "model=small", f"model.from_hf={hf_llama}", "model.seq_len=32",
               "model.layers=2", "model.vocab_pad_multiple=1", "parallel=single")
    assert done.returncode == 0, done.stderr[-2000:]
    assert typed_model_fields(["model=small", "+model.layers=4", "model.heads=2", "train.x=1"]
                              ) == ["layers", "heads"]


def test_a_llama3_context_past_its_positions_is_warned_of_before_the_refusal(tmp_path):
    plan = run("hybrid-plan", "model=llama3-8b", "model.seq_len=16384", "cost.device=h100-80gb")
    train = run("hybrid-train", "model=llama3-8b", "model.seq_len=16384",
                f"hydra.run.dir={tmp_path / 'run'}")
    assert plan.returncode == 0 and train.returncode == 2, (plan.stderr, train.stderr)
    for done in (plan, train):
        first = done.stderr.splitlines()[0]
        assert first.startswith("warning: model.seq_len=16384 is past the 8192 positions") and \
            "model.rope_scaling=llama3" in first, done.stderr
    assert train.stderr.splitlines()[1].startswith("error: the job needs about"), train.stderr


@pytest.mark.parametrize("count, fits", [(11, False), (540, True)])
def test_a_short_token_file_gets_a_use_line_that_fits_or_a_warning(tmp_path, count, fits):
    text = tmp_path / "in.txt"
    text.write_text("the quick brown fox jumps. " * 20)
    text.write_text(text.read_text()[:count])
    done = run("hybrid-data", text, tmp_path / "out")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    use = [line for line in done.stdout.splitlines() if line.startswith("use: ")]
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(
        f"warning: {tmp_path / 'out'} holds {count} tokens, too few"), done.stderr
    assert len(use) == int(fits), done.stdout
    if fits:  # the data checks hybrid-train makes before launch pass on the pasted line
        line = shlex.split(use[0][len("use: "):])
        assert "model.seq_len=32" in line, line
        cfg = compose_train_config(line)
        assert validate_data(cfg.data, cfg.model, cfg.train, cfg.eval) >= cfg.train.global_batch


def test_wordings_name_what_each_command_takes(tmp_path):
    missing = run("hybrid-generate", tmp_path / "nowhere", "prompt=x")
    assert missing.returncode == 2 and errors(missing) == [
        f"error: source {tmp_path / 'nowhere'} does not exist; give a step_* checkpoint "
        f"directory, a run directory or an HF model directory (one holding config.json)"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"model": {}, "train": {}, "parallel": {}}))
    imported = run("hybrid-ckpt", "import", run_dir, tmp_path / "out")
    assert imported.returncode == 2 and len(errors(imported)) == 1, imported.stderr
    assert f"{run_dir} is a hybrid run directory, not an HF model directory" in imported.stderr
    assert f"checkpoint.init_from={run_dir}" in imported.stderr
    text = tmp_path / "in.txt"
    text.write_text("the quick brown fox jumps.\n\n" * 400)
    indexed = run("hybrid-data", text, tmp_path / "pair", "--format", "indexed")
    assert f"to {tmp_path}/pair.bin and {tmp_path}/pair.idx\n" in indexed.stdout, indexed.stdout


def test_a_global_batch_beyond_its_bound_is_advised_with_evaluation_off(tmp_path):
    done = run("hybrid-train", "train.global_batch=4000000", f"hydra.run.dir={tmp_path / 'r'}")
    assert done.returncode == 2 and len(errors(done)) == 1, done.stderr
    assert done.stderr.rstrip().endswith(
        "e.g. train.global_batch=262144 eval.every=0 eval.at_end=false"), done.stderr


def test_evaluations_reads_are_checked_before_the_plan_is_built(tmp_path, monkeypatch):
    """The advice without its evaluation half is refused from the validation split's size
    before ``plan_job`` builds the schedule of 131,072 micro-batches; with it, the data
    checks before launch pass."""
    import launch.commands.train as train
    from launch.commands.run_data import check_eval_early
    from tests.refusals import refusal_in_process

    def planned(*args, **kwargs):
        raise AssertionError("the plan was built before the evaluation's check")

    monkeypatch.setattr(train, "plan_job", planned)
    line = refusal_in_process(["train.global_batch=262144"], tmp_path / "r")
    assert "samples per evaluation" in line and "would read them more than once" in line, line
    check_eval_early(compose_train_config(["train.global_batch=262144", "eval.every=0",
                                           "eval.at_end=false"]))


def _save_hf(kind: str, folder: Path) -> Path:
    import torch
    import transformers as T

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False)
    config, cls = {
        "mixtral": (T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                    bos_token_id=1, eos_token_id=2), T.MixtralForCausalLM),
        "qwen3": (T.Qwen3Config(**common, head_dim=16, bos_token_id=5, eos_token_id=7,
                                max_window_layers=28), T.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    cls(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind, kept", [
    ("mixtral", {"bos_token_id": 1, "eos_token_id": 2}),
    ("qwen3", {"bos_token_id": 5, "eos_token_id": 7, "max_window_layers": 28})])
def test_import_then_export_keeps_the_special_token_ids_hybrid_does_not_model(tmp_path, kind,
                                                                               kept):
    from hybrid.checkpoint.store import read_manifest
    from hybrid.interop.convert import export_hf, import_hf

    source = _save_hf(kind, tmp_path / "hf")
    assert {k: json.loads((source / "config.json").read_text())[k] for k in kept} == kept
    checkpoint = import_hf(str(source), str(tmp_path / "imported"))
    export_hf(checkpoint, read_manifest(checkpoint), str(tmp_path / "out"))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: written.get(k) for k in kept} == kept, written
