"""The README's two opening commands are the ones CI and users run."""

import re
from pathlib import Path

import pytest

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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_main_job_trains_on_english_text_with_the_validation_loss_beside(main_job, user_cache):
    """The README's first command's job as it is (``main_job``): CPython's documentation, the
    loss and the validation loss falling, printed side by side; the corpus built once for the
    machine, in the user's cache."""
    from hybrid.metrics import read_metrics

    run_dir, stdout = main_job
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == [20, 40, 60, 80, 100, 120]
    assert records[-1]["loss"] < records[0]["loss"] - 2 and evals[120] < evals[20]
    assert "step   120/120  eval_loss" in stdout
    # The byte-level corpus, built once in the user's cache (a run with an HF tokenizer adds
    # its own python-docs-<hash>-<tokenizer hash>.bin beside it: test_models_docs).
    byte_level = [path for path in (user_cache / "examples").glob("python-docs-*.bin")
                  if re.fullmatch(r"python-docs-[0-9a-f]+\.bin", path.name)]
    assert len(byte_level) == 1
    assert not (run_dir / "data_cache" / "examples").exists()
