"""On a base install (no ``[hf]`` extra: transformers and safetensors missing) every HF path
ends in one line naming the extra, exit status 2, no traceback: ``hybrid-ckpt import``,
``hybrid-ckpt export --format hf`` and ``hybrid-generate`` from an HF directory, through the
real commands. The missing packages are made so by a ``sitecustomize`` on ``PYTHONPATH``
whose import hook refuses them, as an absent package is refused."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
BLOCKED = ("transformers", "safetensors")
NEEDLE = ("HF conversion needs the hf extra, and safetensors is not installed: "
          "pip install -e '.[hf]' in a checkout of hybrid (or pip install 'hybrid[hf]')")

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # real commands, HF models

BLOCKER = f'''
import sys


class _NotInstalled:
    """Refuses {BLOCKED} and their submodules, as for a package that is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


@pytest.fixture
def base_install(tmp_path) -> dict:
    """The environment of a run without the ``[hf]`` extra."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": str(hook)}


def run(env: dict, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=200,
                          env=env)


def test_the_hook_makes_the_packages_missing(base_install):
    done = run(base_install, sys.executable, "-c", "import safetensors.torch")
    assert done.returncode == 1 and "No module named 'safetensors" in done.stderr


def assert_names_the_extra(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [f"error: {NEEDLE}"], done.stderr


def test_import_names_the_extra(base_install, hf_gpt2, tmp_path):
    done = run(base_install, BIN / "hybrid-ckpt", "import", hf_gpt2, tmp_path / "out")
    assert_names_the_extra(done)
    assert not (tmp_path / "out").exists()


def test_export_as_hf_names_the_extra(base_install, hf_imported, tmp_path):
    done = run(base_install, BIN / "hybrid-ckpt", "export", hf_imported, tmp_path / "out",
               "--format", "hf")
    assert_names_the_extra(done)
    assert not (tmp_path / "out").exists()


def test_generate_from_an_hf_directory_names_the_extra(base_install, hf_gpt2):
    done = run(base_install, BIN / "hybrid-generate", hf_gpt2, "prompt=The", "max_new_tokens=2")
    assert_names_the_extra(done)
    assert done.stdout == ""


def test_a_hybrid_checkpoint_needs_no_extra(base_install, hf_imported):
    """What is not HF does not ask for the extra: generation from a hybrid checkpoint runs."""
    done = run(base_install, BIN / "hybrid-generate", hf_imported, "prompt=The",
               "max_new_tokens=2", "temperature=0")
    assert done.returncode == 0 and done.stdout.startswith("The"), done.stderr[-3000:]
