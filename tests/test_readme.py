"""The README's two opening commands are the ones CI and users run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_commands():
    text = (ROOT / "README.md").read_text()
    before = text.split("```bash\n", 1)[0]
    assert before.count("\n") <= 4, "the two commands must open the README"
    commands = readme_commands()
    assert len(commands) == 2
    assert "torch==2.13.0" in commands[0] and "torch==2.13.0" in commands[1]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci
