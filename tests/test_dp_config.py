"""The DP strategies as Hydra config groups (``hybrid.planning.dp_config``): each file of
``conf/parallel/dp`` selects the strategy it is named after, files that combine compose into
one config, and the flat keys of before give the same config as the group they moved into
(on the command line, in Python and in a saved ``config.json``), or, in a YAML file, one line
naming the new key. Pure: no process starts."""

from dataclasses import replace
from pathlib import Path

import pytest

from hybrid.planning.config import ParallelConfig, from_dict, to_dict
from hybrid.planning.dp_config import FLAT_KEYS, new_key
from hybrid.planning.strategies import DpOptions, reduction_of, sharding_of
from launch.commands.app import CONF_DIR, compose_train_config
from refusals import hydra_compose_refusal

GROUP = sorted(p.stem for p in (Path(CONF_DIR) / "parallel" / "dp").glob("*.yaml"))
SELECTS = {
    # file: (sharding, reduction, balance) it selects
    "exact": ("replicated", "exact", "even"),
    "zero1": ("zero-1", "exact", "even"),
    "zero2": ("zero-2", "exact", "even"),
    "zero3": ("zero-3", "exact", "even"),
    "bf16": ("replicated", "bf16", "even"),
    "powersgd": ("replicated", "powersgd", "even"),
    "local-sgd": ("replicated", "local-sgd", "even"),
    "delayed": ("replicated", "delayed", "even"),
    "dynamic": ("replicated", "exact", "dynamic"),
}
SINGLE = ["parallel=single", "parallel.dp=2"]


def _selected(parallel: ParallelConfig) -> tuple[str, str, str]:
    options = DpOptions.of(parallel)
    return sharding_of(options).name, reduction_of(options).name, parallel.dp_balance


def test_every_file_of_the_group_selects_its_strategy():
    assert GROUP == sorted(SELECTS)
    for name in GROUP:
        cfg = compose_train_config([*SINGLE, f"parallel/dp={name}"])
        assert _selected(cfg.parallel) == SELECTS[name], name


def test_files_that_combine_are_chosen_together_and_tuned_after():
    cfg = compose_train_config([*SINGLE, "parallel/dp=[zero1,bf16,dynamic]",
                                "parallel.dp_strategy.zero.stage=2"])
    assert _selected(cfg.parallel) == ("zero-2", "bf16", "dynamic")


@pytest.mark.parametrize("flat,value,group", [
    ("zero", 3, "zero3"), ("dp_compress", "powersgd", "powersgd"), ("dp_delay", 1, "delayed"),
    ("dp_balance", "dynamic", "dynamic"), ("dp_compress", "bf16", "bf16")])
def test_a_flat_key_of_before_gives_the_config_of_its_group(flat, value, group):
    by_group = compose_train_config([*SINGLE, f"parallel/dp={group}"])
    by_flat = compose_train_config([*SINGLE, f"parallel.{flat}={value}"])
    by_new = compose_train_config([*SINGLE, f"parallel.{new_key(flat)}={value}"])
    assert by_flat == by_new
    assert _selected(by_flat.parallel) == _selected(by_group.parallel)
    assert getattr(by_flat.parallel, flat) == value


def test_flat_keys_in_python_and_in_a_saved_config():
    """Arguments, attributes (read and written), ``replace`` (which leaves the original
    alone: the nested settings are shared, never mutated) and a config.json of before."""
    nested = compose_train_config([*SINGLE, "parallel/dp=[zero3,local-sgd]"]).parallel
    flat = ParallelConfig(dp=2, zero=3, dp_sync_every=4, dp_sync_moments=True)
    assert flat == nested and flat.zero == 3 and flat.dp_strategy.zero.stage == 3
    changed = replace(flat, zero=1, bucket_mb=0.5)
    assert (changed.zero, changed.bucket_mb, flat.zero, flat.bucket_mb) == (1, 0.5, 3, 25.0)
    changed.dp_delay = 1
    assert changed.dp_strategy.delay == 1 and flat.dp_strategy.delay == 0
    saved = to_dict(flat)
    assert not FLAT_KEYS.keys() & saved.keys()  # written in the new places only
    before = {key: value for key, value in saved.items() if key != "dp_strategy"}
    before.update(zero=3, dp_sync_every=4, dp_sync_moments=True)
    assert from_dict(before, ParallelConfig) == flat == from_dict(saved, ParallelConfig)


def test_a_flat_key_in_a_yaml_file_is_refused_in_one_line_naming_the_new_key():
    """The command line's flat keys are rewritten (``new_overrides``); Hydra's own compose,
    as a YAML file does, meets the key where it no longer is."""
    line = hydra_compose_refusal("parallel.dp_delay=1")
    assert "\n" not in line
    assert line.endswith("; parallel.dp_delay is now parallel.dp_strategy.delay (or choose a "
                         "file of conf/parallel/dp: parallel/dp=NAME)"), line
