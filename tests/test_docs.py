"""docs/ stays true: the config reference is generated from the schema."""

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
