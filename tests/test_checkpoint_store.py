"""Checkpoint directories without processes: naming, completeness, resolution, pruning, the
manifest's checks, and the metadata unpickler that admits only DCP's classes."""

import json
import pickle

import pytest

from hybrid.checkpoint.store import (
    MANIFEST, CheckpointError, check_files, check_model_matches, complete_checkpoints,
    model_shape, prune, resolve_resume, write_manifest,
)
from hybrid.planning.config import ModelConfig


def make_checkpoint(directory, step, *, complete=True, files=None):
    path = directory / (f"step_{step:08d}" + ("" if complete else ".tmp"))
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    files = files or {"__0_0.distcp": b"abc"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    if complete:
        write_manifest(path, {"format": 1, "step": step, "model": model_shape(ModelConfig()),
                              "files": {n: {"bytes": len(d), "crc32": 0}
                                        for n, d in files.items()}})
    return path


def test_only_complete_checkpoints_count_and_auto_takes_the_newest(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    make_checkpoint(ckpts, 2)
    make_checkpoint(ckpts, 10)
    make_checkpoint(ckpts, 12, complete=False)  # an interrupted save
    (ckpts / "step_00000011").mkdir()  # DCP files but no manifest: not complete either
    assert [s for s, _ in complete_checkpoints(ckpts)] == [2, 10]
    assert resolve_resume("auto", ckpts).name == "step_00000010"
    assert resolve_resume(str(tmp_path / "run"), ckpts).name == "step_00000010"  # a run dir
    assert resolve_resume(str(ckpts / "step_00000002"), ckpts).name == "step_00000002"
    assert resolve_resume("auto", tmp_path / "empty") is None  # auto: start fresh
    assert resolve_resume(None, ckpts) is None


@pytest.mark.parametrize("target, needle", [
    ("missing", "does not exist"),
    ("checkpoints/step_00000011", "is not a complete checkpoint"),
    ("checkpoints/step_00000012.tmp", "holds no complete checkpoint"),
])
def test_resume_from_a_bad_path_names_it(tmp_path, target, needle):
    make_checkpoint(tmp_path / "checkpoints", 12, complete=False)
    (tmp_path / "checkpoints" / "step_00000011").mkdir()
    with pytest.raises(CheckpointError, match=needle):
        resolve_resume(str(tmp_path / target), tmp_path / "checkpoints")


def test_a_checkpoint_without_dcp_metadata_names_that_file_not_its_manifest(tmp_path):
    """#43: a deleted ``.metadata`` was reported as a missing hybrid.json (which is there)."""
    path = make_checkpoint(tmp_path / "run" / "checkpoints", 4)
    (path / ".metadata").unlink()
    damaged = "is damaged: it lacks DCP's .metadata, the index of its tensors (its hybrid.json " \
              "is there)"
    with pytest.raises(CheckpointError) as err:
        resolve_resume(str(path), path.parent)
    assert str(err.value) == (f"checkpoint.resume_from={path} {damaged}; resume from an older "
                              f"step_* directory")
    with pytest.raises(CheckpointError) as err:
        resolve_resume(str(tmp_path / "run"), path.parent)
    assert str(err.value) == (f"checkpoint.resume_from={tmp_path / 'run'} holds no complete "
                              f"checkpoint: its newest, step_00000004, {damaged}; give an older "
                              f"step_* directory or a run directory that saved one")


def test_prune_removes_interrupted_saves_and_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 5, complete=False)
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    prune(tmp_path, keep=0)  # 0 keeps all
    assert len(list(tmp_path.iterdir())) == 2


def test_truncated_files_and_other_models_are_refused_with_both_values(tmp_path):
    path = make_checkpoint(tmp_path, 3, files={"__0_0.distcp": b"abcdef"})
    manifest = json.loads((path / MANIFEST).read_text())
    check_files(path, manifest)
    (path / "__0_0.distcp").write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="has 3 bytes, the save wrote 6"):
        check_files(path, manifest)
    check_model_matches(manifest, ModelConfig(), path)
    with pytest.raises(CheckpointError, match="model.ffn_hidden: the checkpoint step_00000003 "
                                              "has ffn=128, the config ffn=96"):
        check_model_matches(manifest, ModelConfig(ffn_hidden=96), path)
    with pytest.raises(CheckpointError, match="tie_embeddings=false, the config "
                                              "tie_embeddings=true"):
        check_model_matches(manifest, ModelConfig(tie_embeddings=True), path)


class Boom:
    def __reduce__(self):
        import os
        return (os.system, ("echo pwned",))


def test_metadata_unpickler_refuses_anything_but_dcp_classes(tmp_path):
    from hybrid.checkpoint.dcp_io import read_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CheckpointError, match="asks to load posix.system"):
        read_metadata(tmp_path)


def test_a_checkpoint_at_the_last_step_leaves_nothing_to_train(tmp_path):
    from hybrid.planning.config import Config, TrainConfig
    from launch.commands.train import resolve_checkpointing

    path = make_checkpoint(tmp_path / "checkpoints", 10)
    cfg = Config(train=TrainConfig(steps=10))
    cfg.checkpoint.resume_from = "auto"
    with pytest.raises(CheckpointError, match="is at step 10, train.steps=10 leaves nothing"):
        resolve_checkpointing(cfg, tmp_path)
    cfg = Config(train=TrainConfig(steps=12))
    cfg.checkpoint.resume_from = "auto"
    directory, resume, init = resolve_checkpointing(cfg, tmp_path)
    assert init is None
    assert resume == str(path.resolve())
    assert directory == str((tmp_path / "checkpoints").resolve())
    assert cfg.checkpoint.resume_from == "auto" and cfg.checkpoint.dir is None  # untouched


class CallsDcp:
    def __reduce__(self):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        return (dcp_to_torch_save, ("/nowhere", "/tmp/overwritten"))


def test_metadata_unpickler_admits_dcp_classes_but_not_dcp_functions(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    from hybrid.checkpoint.dcp_io import read_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
    assert read_metadata(tmp_path).state_dict_metadata == {}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(CallsDcp()))
    with pytest.raises(CheckpointError, match="format_utils.dcp_to_torch_save"):
        read_metadata(tmp_path)


def test_init_from_under_another_rope_starts_and_says_which_settings_differ(tmp_path, capsys):
    """A context-extension fine-tune changes the rope on purpose: ``checkpoint.init_from``
    takes it, in one ``note:`` line naming each setting and the checkpoint's value; a resume
    under it is warned of (its losses are no longer the saved run's)."""
    from dataclasses import asdict, replace

    from hybrid.planning.config import Config, TrainConfig
    from launch.commands.train import resolve_checkpointing

    path = make_checkpoint(tmp_path / "checkpoints", 2)
    manifest = json.loads((path / MANIFEST).read_text())
    write_manifest(path, {**manifest, "config": {"model": asdict(ModelConfig())}})
    longer = replace(ModelConfig(), rope_base=500000.0, norm_eps=1e-6)
    cfg = Config(model=longer, train=TrainConfig(steps=4))
    cfg.checkpoint.init_from = str(path)
    assert resolve_checkpointing(cfg, tmp_path / "new")[2] == str(path.resolve())
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["note: starting from step_00000002 with model.rope_base=500000.0 (the "
                     "checkpoint's: 10000.0), model.norm_eps=1e-06 (the checkpoint's: 1e-05); "
                     "no weight depends on these"], lines
    cfg = Config(model=longer, train=TrainConfig(steps=4))
    cfg.checkpoint.resume_from = "auto"
    resolve_checkpointing(cfg, tmp_path)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("warning: resuming with model.")
                                   for line in lines), lines
