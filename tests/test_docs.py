"""docs/ stays true: the config reference is generated from the schema, and the table of DP
strategies x placements is held by tests."""

import re
from pathlib import Path

from launch.commands.config_reference import render

ROOT = Path(__file__).resolve().parent.parent


def test_config_reference_is_up_to_date():
    page = (ROOT / "docs" / "config.md").read_text()
    assert page == render(), "regenerate: python -m launch.commands.config_reference > docs/config.md"


def test_every_schema_field_is_documented():
    for line in render().splitlines():
        if line.startswith("| `"):
            assert not line.rstrip().endswith("|  |"), f"undocumented: {line}"


def _strategies_table(doc: str) -> str:
    text = (ROOT / "docs" / doc).read_text()
    block = re.search(r"<!-- strategies-by-placement -->\n(.*?)<!-- /strategies-by-placement -->",
                      text, re.S)
    assert block, f"docs/{doc} lost its table of DP strategies x placements"
    return block[1]


def test_the_strategies_by_placement_table_is_held_by_tests():
    """docs/data-parallel.md's table of DP strategies x placements (docs/moe.md holds the same):
    a row for every registered reduction and ZeRO stage, every cell held by a test function
    that exists, the expert column's rows the strategies test_moe_dp_strategies runs at ep2,
    each with the bound that test holds it to."""
    from hybrid.planning.strategies import REDUCTIONS, SHARDINGS
    from test_moe import LAYOUTS
    from test_moe_dp_strategies import STRATEGIES

    table = _strategies_table("data-parallel.md")
    assert _strategies_table("moe.md") == table
    legend = dict(re.findall(r"^- \[([\w-]+)\]: `(tests/\S+::\w+)`$", table, re.M))
    for label, test in legend.items():
        path, name = test.split("::")
        assert f"\ndef {name}(" in (ROOT / path).read_text(), f"[{label}]: {test} is gone"
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| `")]
    keys = [row[0].strip("`") for row in rows]
    assert set(REDUCTIONS) | {f"zero{s}" for s in SHARDINGS if s} <= set(keys)
    assert keys == list(STRATEGIES)
    for key, (_, _, dense, expert) in zip(keys, rows):
        for cell in (dense, expert):
            labels = re.findall(r"\[([\w-]+)\]", cell)
            assert labels and set(labels) <= set(legend), (key, cell)
        assert "[moe-dp]" in expert, (key, expert)
        assert float(re.search(r"rtol (\S+) ", expert)[1]) == STRATEGIES[key][1]["norms"], key
        if "[moe]" in expert:  # a hybrid-train run of that strategy with ep > 1
            assert any("-ep" in name and (key in name or key == "exact")
                       for name in LAYOUTS), (key, expert)
