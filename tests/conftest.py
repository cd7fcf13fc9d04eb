"""Fixtures that several test files share."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory) -> dict[str, Path]:
    """The run directories of ``test_train_e2e``'s 1-process runs, untied and tied embeddings:
    what every layout and every launcher must reproduce. Tests read them, never write."""
    from test_train_e2e import TIED, run_train

    out = {}
    for name, extra in (("untied", []), ("tied", TIED)):
        run_dir = tmp_path_factory.mktemp(f"reference-{name}")
        done = run_train(run_dir, "parallel=single", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = run_dir
    return out


@pytest.fixture(scope="session")
def reference(reference_runs) -> dict[str, list[float]]:
    """The losses of ``reference_runs``, by name."""
    from test_train_e2e import STEPS, losses_of

    out = {name: losses_of(run_dir) for name, run_dir in reference_runs.items()}
    assert all(len(losses) == STEPS for losses in out.values())
    return out
