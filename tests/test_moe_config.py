"""The MoE settings nested under ``model.moe`` (``hybrid.planning.moe_config``): a dense preset
lists none, the flat keys of before give the same config (on the command line, in Python, in a
saved ``config.json`` and in a checkpoint manifest), or, in a YAML file, one line naming the
new key. Pure: no process starts."""

from pathlib import Path

import pytest
import yaml

from hybrid.checkpoint.shape import saved_shape, setting_changes
from hybrid.checkpoint.store import CheckpointError, check_model_matches, model_shape
from hybrid.interop.convert import model_config_of, shape_overrides
from hybrid.planning.config import Config, ModelConfig, from_dict, to_dict
from hybrid.planning.moe_config import FLAT_KEYS, MoEConfig, new_key
from launch.commands.app import CONF_DIR, compose_train_config
from refusals import hydra_compose_refusal

MOE_TINY = ["model=moe-tiny", "parallel=single"]


def test_a_dense_preset_lists_no_moe_field_and_composes_dense():
    text = (Path(CONF_DIR) / "model" / "llama-tiny.yaml").read_text()
    listed = yaml.safe_load(text)
    assert "moe" not in listed and not FLAT_KEYS.keys() & listed.keys()
    assert compose_train_config(["model=llama-tiny"]).model.moe == MoEConfig()
    assert compose_train_config(MOE_TINY).model.moe.experts == 4


@pytest.mark.parametrize("flat,value", [("experts", 8), ("experts_topk", 1),
                                        ("moe_aux_loss", 0.02), ("moe_dense_layers", "[1]"),
                                        ("moe_capacity_factor", 1.5), ("moe_router",
                                                                       "topk_softmax")])
def test_a_flat_key_on_the_command_line_gives_the_config_of_its_new_key(flat, value):
    by_flat = compose_train_config([*MOE_TINY, f"model.{flat}={value}"])
    by_new = compose_train_config([*MOE_TINY, f"model.{new_key(flat)}={value}"])
    assert by_flat == by_new and by_new != compose_train_config(MOE_TINY)


def test_a_flat_key_in_a_yaml_file_is_refused_in_one_line_naming_the_new_key():
    line = hydra_compose_refusal("model.moe_aux_loss=0.1")
    assert "\n" not in line
    assert line.endswith("; model.moe_aux_loss is now model.moe.aux_loss"), line


def test_flat_keys_in_python_and_the_cache_key_round_trip():
    nested = compose_train_config(MOE_TINY).model
    flat = ModelConfig(**{**to_dict(nested), "moe": {}}, experts=4, experts_topk=2,
                       moe_ffn_hidden=32, moe_aux_loss=0.01)
    assert flat == nested and flat.experts == 4 and flat.moe_aux_loss == 0.01
    assert ModelConfig(**dict(nested.cache_key())) == nested
    hash(nested.with_moe(dense_layers=[1]).cache_key())
    changed = nested.with_moe(every=2)
    assert (changed.moe.every, nested.moe.every) == (2, 1)


def _flat_form(model: dict) -> dict:
    """A saved model section as hybrid wrote it before ``model.moe``."""
    moe = model.pop("moe")
    model.update({flat: moe[path] for flat, path in FLAT_KEYS.items()})
    return model


def test_a_saved_run_config_in_the_flat_form_loads_identically():
    cfg = compose_train_config(MOE_TINY)
    saved = to_dict(cfg)
    assert from_dict(saved) == cfg
    old = {**saved, "model": _flat_form(dict(saved["model"]))}
    assert "experts" in old["model"] and "moe" not in old["model"]
    assert from_dict(old) == cfg and isinstance(from_dict(old), Config)


def test_a_checkpoint_manifest_in_the_flat_form_loads_and_its_refusals_name_the_new_keys():
    model = compose_train_config(MOE_TINY).model
    old = {"model": model_shape(model), "config": {"model": _flat_form(to_dict(model))},
           "tensors": {}}
    assert model_config_of(old) == model
    assert saved_shape(old) == model_shape(model)
    check_model_matches(old, model, Path("s"))  # resume: the same model loads
    assert setting_changes(old, model.with_moe(topk=1)) == [
        "model.moe.topk=1 (the checkpoint's: 2)"]
    with pytest.raises(CheckpointError) as err:
        check_model_matches(old, model.with_moe(every=2), Path("step_00000002"))
    assert str(err.value).startswith("model.moe.every: the checkpoint step_00000002 has "
                                     "moe_every=1, the config moe_every=2; set "
                                     "model.moe.every=1"), err.value


def test_an_imported_moe_prints_the_new_keys_and_they_compose():
    model = compose_train_config(MOE_TINY).model
    use = shape_overrides(model)
    assert "model.moe.experts=4" in use and "model.moe.aux_loss=0.01" in use
    assert not [o for o in use if o.split("=")[0].removeprefix("model.") in FLAT_KEYS]
    again = compose_train_config(["model=llama-tiny", "parallel=single", *use]).model
    assert again.moe == model.moe
