"""Fixtures that several test files share."""

import pytest


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[str, list[float]]:
    """The 1-process losses of ``test_train_e2e``'s runs, untied and tied embeddings: what
    every layout and every launcher must reproduce."""
    from test_train_e2e import STEPS, TIED, losses_of, run_train

    out = {}
    for name, extra in (("untied", []), ("tied", TIED)):
        run_dir = tmp_path_factory.mktemp(f"reference-{name}")
        done = run_train(run_dir, "parallel=single", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = losses_of(run_dir)
        assert len(out[name]) == STEPS
    return out
