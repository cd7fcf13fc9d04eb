"""Every fix the validator suggests passes validation itself (#43 item 7).

ZeRO-3 with ``parallel.dp_delay`` suggested ``parallel.zero=1``, which was then refused with a
suggestion of ``parallel.zero=0``. Here every refusal of ``config_problems`` that carries an
override (``set F=V``, ``use F=V or G=W``, ``choose F in {...}``, ``choose one of ...``) is
collected over a table of bad configs and a grid of every DP option combination; each
suggested override is applied and the config validated again. It must not be refused again for
the field the fix set (a circular suggestion), nor with the same line; the overrides are
parsed from the message as a person would paste them.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any, Optional

import pytest
import yaml

from hybrid.planning.config import Config
from hybrid.planning.validate import config_problems

SECTIONS = ("parallel", "train", "model", "data", "eval", "checkpoint", "launcher", "optim")
VERB = re.compile(r"(?:^|[;:] )(?:set|use|choose|give it one, e\.g\.) ")
PAIR = re.compile(r"\b([a-z_][\w.]*)=(\[[^\]]*\]|[^\s,;()]+)")
CHOICES = re.compile(r"\b([a-z_][\w.]*) in \{([^}]*)\}")
ONE_OF = re.compile(r"^([a-z_][\w.]*)=\S+ is unknown; choose one of (\S+?)[,\s]")


def qualified(name: str) -> Optional[str]:
    """``tp`` -> ``parallel.tp``: a short field name as the section that has it."""
    if "." in name:
        return name
    for section in SECTIONS:
        if name in {f.name for f in dataclasses.fields(getattr(Config(), section))}:
            return f"{section}.{name}"
    return None


def get(cfg: Config, field: str) -> Any:
    section, name = field.split(".", 1)
    return getattr(getattr(cfg, section), name)


def apply(cfg: Config, overrides: dict[str, Any]) -> Config:
    for field, value in overrides.items():
        section, name = field.split(".", 1)
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(
            getattr(cfg, section), **{name: value})})
    return cfg


def suggested(message: str, cfg: Config) -> list[dict[str, Any]]:
    """The overrides a message suggests, one dict per alternative (``set A=1 or B=2``: two);
    a value list ``choose tp in {1, 2, 4}`` gives its first value other than the current."""
    unknown = ONE_OF.match(message)
    if unknown:
        return [{qualified(unknown[1]): yaml.safe_load(unknown[2])}]
    verb = list(VERB.finditer(message))
    if not verb:
        return []
    fix = message[verb[-1].end():]
    found = []
    for part in re.split(r",? or ", fix):
        if part.startswith("drop "):  # dropping a setting is no override to paste
            continue
        choice = CHOICES.search(part)
        if choice:
            field = qualified(choice[1])
            values = [yaml.safe_load(v) for v in choice[2].split(", ") if v != "..."]
            others = [v for v in values if v != get(cfg, field)]
            if others:
                found.append({field: others[0]})
            continue
        pairs = {qualified(name): yaml.safe_load(value) for name, value in PAIR.findall(part)}
        if pairs and None not in pairs:
            found.append(pairs)
    return found


def make(**sections: dict) -> Config:
    """A 2x2x2 tiny job (valid), with ``sections``' fields changed."""
    base = {"parallel": {"dp": 2, "tp": 2, "pp": 2}, "train": {"steps": 8},
            "model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32}}
    cfg = Config()
    for section in set(base) | set(sections):
        fields = {**base.get(section, {}), **sections.get(section, {})}
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(
            getattr(cfg, section), **fields)})
    return cfg


TABLE = [
    make(parallel={"tp": 3}),
    make(parallel={"tp": 8}, model={"heads": 8, "ffn_hidden": 100}),
    make(model={"heads": 5}),
    make(parallel={"pp": 4, "vpp": 2, "schedule": "interleaved-1f1b"}),
    make(train={"global_batch": 15}),
    make(train={"global_batch": 6}),
    make(parallel={"pp": 4, "vpp": 1, "schedule": "interleaved-1f1b"}, model={"layers": 8}),
    make(parallel={"vpp": 2}),
    make(parallel={"dp": 1, "vpp": 1, "schedule": "zb-v"}),
    make(parallel={"dp": 1, "vpp": 2, "schedule": "zb-v"}, train={"device": "cuda"}),
    make(parallel={"dp": 1, "pp": 1, "schedule": "zb-v", "vpp": 2}),
    make(parallel={"dp": 1, "vpp": 2, "schedule": "interleaved-1f1b"},
         train={"global_batch": 6}),
    make(parallel={"schedule": "1f2b"}),
    make(parallel={"zero3_reshard": "never"}),
    make(parallel={"partition": "even"}),
    make(parallel={"zero": 5}),
    make(parallel={"dp_compress": "fp8"}),
    make(parallel={"cp": 3}),
    make(parallel={"cp": 2, "tp": 4, "sequence_parallel": True}, model={"seq_len": 12}),
    make(parallel={"cp": 2, "dp_sync_every": 2}),
    make(parallel={"sequence_parallel": True}, model={"seq_len": 33}),
    make(parallel={"block_costs": [1.0] * 6}),
    make(parallel={"partition": "measured", "block_costs": [1.0]}),
    make(train={"precision": "fp16"}),
    make(train={"device": "tpu"}),
    make(model={"recompute": "most"}),
    make(optim={"min_lr": 1.0}),
    make(optim={"implementation": "jit"}),
    make(launcher={"start_method": "fork"}),
    make(launcher={"nnodes": 3}),
    make(launcher={"nproc_per_node": 4}),
    make(launcher={"nnodes": 2, "node_rank": 2}),
    make(launcher={"nnodes": 2, "rdzv_endpoint": "node0"}),
    make(data={"source": "files"}),
    make(data={"source": "tokens", "path": "t.bin"}, eval={"every": 5}),
    make(data={"source": "indexed", "path": "p", "split": [1, 0, 0]}, eval={"at_end": True}),
    make(data={"source": "indexed", "path": "p", "split": [9, 1]}),
    make(data={"source": "indexed", "example": "python-docs", "path": "p"}),
    make(data={"source": "synthetic", "blend": [1, "a"]}),
    make(data={"source": "indexed", "blend": [1, "a", 2]}),
]
"""Bad configs beyond the DP options, one per kind of refusal that names a fix."""


def dp_grid() -> list[Config]:
    """Every combination of the DP options (and the run lengths and saves they check)."""
    grid = itertools.product((0, 1, 2, 3), ("none", "bf16", "powersgd"), (1, 2), (0, 1),
                             (False, True), (1, 2), (0, 2, 3), (4, 5))
    return [make(parallel={"dp": dp, "zero": zero, "dp_compress": compress,
                           "dp_sync_every": every, "dp_delay": delay, "dp_sync_moments": moments},
                 checkpoint={"every": saves}, train={"steps": steps})
            for zero, compress, every, delay, moments, dp, saves, steps in grid]


def refusals_with_fixes(configs: list[Config]) -> list[tuple[Config, str, dict]]:
    """(config, refusal, one suggested override) for every refusal that suggests one."""
    found = []
    for cfg in configs:
        for problem in config_problems(cfg):
            for fix in suggested(problem, cfg):
                found.append((cfg, problem, fix))
    return found


def circular(fixed: Config, fix: dict) -> list[str]:
    """The problems of ``fixed`` that are about, or suggest changing again, a field the fix
    set."""
    out = []
    for problem in config_problems(fixed):
        again = {field for alternative in suggested(problem, fixed) for field in alternative}
        about = re.match(r"([a-z_][\w.]*)=", problem)
        if again & set(fix) or (about and qualified(about[1]) in fix):
            out.append(problem)
    return out


def test_the_parser_reads_each_form_of_suggestion():
    cfg = make(parallel={"tp": 3})
    assert suggested("parallel.tp=3 does not divide model.heads=4; choose tp in {1, 2, 4}",
                     cfg) == [{"parallel.tp": 1}]
    assert suggested("x; set parallel.dp_sync_moments=true or checkpoint.every=0", cfg) == \
        [{"parallel.dp_sync_moments": True}, {"checkpoint.every": 0}]
    assert suggested("parallel.schedule='1f2b' is unknown; choose one of gpipe, 1f1b", cfg) \
        == [{"parallel.schedule": "gpipe"}]
    assert suggested("a: set parallel.vpp=2 or use schedule=1f1b", cfg) == \
        [{"parallel.vpp": 2}, {"parallel.schedule": "1f1b"}]
    assert suggested("no validation part; give it one, e.g. data.split=[969,30,1], or "
                     "eval.every=0", cfg) == [{"data.split": [969, 30, 1]}, {"eval.every": 0}]


def test_the_table_and_the_grid_reach_every_kind_of_suggestion():
    """The collection is systematic: most of the table's refusals carry a parsed fix, and the
    DP grid reaches each DP refusal that names one."""
    table = refusals_with_fixes(TABLE)
    assert len({problem for _, problem, _ in table}) >= 20
    grid = {problem.split("=")[0] for _, problem, _ in refusals_with_fixes(dp_grid())}
    assert {"parallel.zero", "parallel.dp_delay", "parallel.dp_compress", "train.steps",
            "checkpoint.every", "parallel.dp_sync_every"} <= grid


@pytest.mark.parametrize("name, configs", [("table", TABLE), ("dp-grid", dp_grid())])
def test_every_suggested_fix_passes_validation_of_what_it_fixed(name, configs):
    broken = []
    for cfg, problem, fix in refusals_with_fixes(configs):
        fixed = apply(cfg, fix)
        after = config_problems(fixed)
        loops = circular(fixed, fix)
        if problem in after or loops:
            broken.append(f"{problem}\n  -> {fix}\n  -> {(loops or [problem])[0]}")
    assert not broken, f"{len(broken)} suggested fixes are refused again:\n" + \
        "\n".join(sorted(set(broken))[:12])


def test_zero_3_with_a_lossy_reduction_suggests_a_stage_it_runs_on():
    """The issue's case: ZeRO-3 with dp_delay (and local SGD) named zero=1, refused again."""
    for option in ({"dp_delay": 1}, {"dp_sync_every": 2}):
        cfg = make(parallel={"zero": 3, **option})
        problem = config_problems(cfg)[0]
        assert suggested(problem, cfg)[0] == {"parallel.zero": 0}, problem
        assert config_problems(apply(cfg, {"parallel.zero": 0})) == []
