"""Render the config reference (docs/config.md) from the schema's field docstrings.

    python -m launch.commands.config_reference > docs/config.md

A test regenerates it and compares, so the page cannot drift from the schema
(``hybrid/planning/config.py``, ``model_config.py`` and ``run_config.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from hybrid.planning import config as schema
from hybrid.planning import moe_config
from hybrid.planning.dp_config import FLAT_KEYS, SECTION, new_key
from launch.commands.app import CONF_DIR

SECTIONS = [("parallel", schema.ParallelConfig), ("model", schema.ModelConfig),
            ("train", schema.TrainConfig), ("data", schema.DataConfig),
            ("eval", schema.EvalConfig),
            ("optim", schema.OptimConfig), ("launcher", schema.LauncherConfig),
            ("checkpoint", schema.CheckpointConfig), ("cost", schema.CostConfig)]


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under it in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            text = " ".join(str(after.value.value).split())
            docs[node.target.id] = text.replace("|", "\\|")  # a bare | would end the cell
    return docs


def composed_defaults() -> dict:
    """``conf/config.yaml`` composed with no overrides: what ``hybrid-train`` runs."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from launch.commands.app import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="config"), resolve=True)


def _show(value: object) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def render() -> str:
    lines = ["# Config reference", "",
             "Generated from `hybrid/planning/config.py` (and `model_config.py`, `run_config.py`) by "
             "`python -m launch.commands.config_reference`; every key "
             "is typed, so a misspelt key or a wrong type fails when Hydra composes the config.",
             "Override any key on the command line: `hybrid-train parallel.tp=2 train.steps=50`.",
             "Defaults are those of the main job (`conf/config.yaml` composed with no overrides).",
             ""]
    top, defaults = field_docs(schema.Config), composed_defaults()
    lines += ["## top level", "", "| key | default | meaning |", "| --- | --- | --- |",
              f"| `seed` | {defaults['seed']} | {top['seed']} |", ""]
    for name, cls in SECTIONS:
        docs = field_docs(cls)
        lines += [f"## {name}", ""]
        if (Path(CONF_DIR) / name).is_dir():  # a section without presets has no group files
            lines += [f"Group files: `conf/{name}/*.yaml`.", ""]
        lines += ["| key | default | meaning |", "| --- | --- | --- |"]
        lines += _rows(name, cls, defaults[name])
        lines.append("")
        if cls is schema.ParallelConfig:
            lines += _flat_dp_keys()
        if cls is schema.ModelConfig:
            lines += _flat_moe_keys()
    return "\n".join(lines + _plan_only())


def _rows(prefix: str, cls: type, defaults: dict) -> list[str]:
    """One row a key; a nested section's keys (``parallel.dp_strategy.zero.stage``) follow
    its own row."""
    docs, rows = field_docs(cls), []
    for f in dataclasses.fields(cls):
        nested = f.default_factory if dataclasses.is_dataclass(f.default_factory) else None
        value = "(section)" if nested else _show(defaults[f.name])
        rows.append(f"| `{prefix}.{f.name}` | {value} | {docs.get(f.name, '')} |")
        if nested:
            rows += _rows(f"{prefix}.{f.name}", nested, defaults[f.name])
    return rows


def _flat_dp_keys() -> list[str]:
    """The DP strategies' flat keys of before, each with its new place."""
    lines = [f"Group files: `conf/parallel/dp/*.yaml` (package `parallel.{SECTION}`): one "
             f"(`parallel/dp=zero3`) or several (`parallel/dp=[zero1,bf16]`).", "",
             "The flat keys of before still work, on the command line and in Python; in a "
             "YAML file, write the new key.", "", "| flat key | now |", "| --- | --- |"]
    lines += [f"| `parallel.{flat}` | `parallel.{new_key(flat)}` |" for flat in FLAT_KEYS]
    return lines + [""]


def _flat_moe_keys() -> list[str]:
    """The MoE settings' flat keys of before, each with its new place."""
    lines = ["A dense preset lists no `model.moe.*` key (experts=0); an MoE preset "
             "(`conf/model/moe-tiny.yaml`) lists a `moe:` block. The flat keys of before still "
             "work, on the command line, in Python and in a saved config or checkpoint; in a "
             "YAML file, write the new key.", "", "| flat key | now |", "| --- | --- |"]
    lines += [f"| `model.{flat}` | `model.{moe_config.new_key(flat)}` |"
              for flat in moe_config.FLAT_KEYS]
    return lines + [""]


def _plan_only() -> list[str]:
    """The keys only ``hybrid-plan`` takes (``conf/plan.yaml``)."""
    lines = ["## hybrid-plan only", "", "| key | default | meaning |", "| --- | --- | --- |"]
    search, plan = field_docs(schema.SearchConfig), field_docs(schema.PlanConfig)
    for f in dataclasses.fields(schema.SearchConfig):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        lines.append(f"| `search.{f.name}` | {_show(default)} | {search.get(f.name, '')} |")
    for name in ("format", "full"):
        default = next(f.default for f in dataclasses.fields(schema.PlanConfig) if f.name == name)
        lines.append(f"| `{name}` | {_show(default)} | {plan.get(name, '')} |")
    return lines + [""]


if __name__ == "__main__":
    print(render(), end="")
