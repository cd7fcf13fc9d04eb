"""Fixtures that several test files share."""

import os
from pathlib import Path

import pytest

# One OpenMP thread for whatever runs in the two pytest workers themselves (in-process models,
# spawned test jobs, the commands the tests start): two workers on two cores, each computing
# with both, only take turns. Set before any test module imports torch; a value the person
# running the suite set wins. hybrid-train's workers take theirs from launcher.omp_threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Test files that share an expensive session fixture run on one xdist worker, so it is built
# once: the README's main job (about a minute of both cores).
SHARED_GROUPS = {"test_main_job_resume.py": "main_job", "test_readme.py": "main_job"}

# The groups that take longest (minutes each: multi-process runs one after another, from a
# full run's --durations), handed out first, longest first, so that no long group is left to
# run alone at the end while the other worker idles; the others follow by their number of
# slow tests (seconds each; a fast one takes milliseconds), then of tests. An ordering only:
# a stale entry costs time, never a result.
LONGEST_FIRST = ("main_job", "test_elastic.py", "test_signals.py", "test_slurm.py",
                 "test_bench_smoke.py", "test_stall.py")


def _group_of(nodeid: str) -> str:
    """A test's xdist group: its file's name, or the group ``SHARED_GROUPS`` gives it."""
    name = Path(nodeid.split("::", 1)[0]).name
    return SHARED_GROUPS.get(name, name)


def _file_groups_scheduler():
    """xdist's ``loadscope`` scheduler with ``_group_of`` as the scope: each file's tests go
    to one worker, as ``--dist loadgroup`` was meant to send them (its marks never took under
    pytest 9, which ignores the ``_nodeid`` xdist 3.8 rewrites: every test went its own way,
    and both workers built the module and session fixtures they used)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # the order pytest_collection_modifyitems set

        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

    return FileGroupScheduling


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return _file_groups_scheduler()(config, log)
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """In an xdist worker (whose collection is the order the scheduler hands groups out in):
    the groups of ``LONGEST_FIRST`` first, then the others by their number of slow tests,
    then of tests, most first; each group's tests together, in their own order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow: dict[str, int] = {}
    count: dict[str, int] = {}
    for item in items:
        group = _group_of(item.nodeid)
        slow[group] = slow.get(group, 0) + (item.get_closest_marker("slow") is not None)
        count[group] = count.get(group, 0) + 1
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}

    def key(item) -> tuple:
        group = _group_of(item.nodeid)
        return first.get(group, len(first)), -slow[group], -count[group], group

    items.sort(key=key)  # stable: a group's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory) -> Path:
    """The user's cache (``$XDG_CACHE_HOME``) of every run the tests start: one for the session,
    so the built-in corpus is built once, as on a user's machine, and never in the user's own
    cache."""
    cache = tmp_path_factory.mktemp("user-cache")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    return cache / "hybrid"


@pytest.fixture(scope="session")
def main_job(tmp_path_factory) -> tuple[Path, str]:
    """The README's main job as it is (its run directory chosen, and a checkpoint at steps 116
    and 120, which changes nothing in training): its run directory and console output."""
    import subprocess
    import sys

    run_dir = tmp_path_factory.mktemp("main-job")
    done = subprocess.run([str(Path(sys.executable).parent / "hybrid-train"),
                           f"hydra.run.dir={run_dir}", "checkpoint.every=116"],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done.stdout


class _OnFirstUse(dict):
    """A dict whose values are made when first read (``make(key)``): a worker whose tests
    read only one of the reference runs trains only that one."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory) -> dict[str, Path]:
    """The run directories of ``test_train_e2e``'s 1-process runs, ``"untied"`` and ``"tied"``
    embeddings: what every layout and every launcher must reproduce. Tests read them, never
    write."""
    from test_train_e2e import TIED, run_train

    def train(run_dir: Path, name: str) -> None:
        done = run_train(run_dir, "parallel=single", *{"untied": [], "tied": TIED}[name])
        assert done.returncode == 0, done.stderr[-3000:]

    return _OnFirstUse(lambda name: _made_once_per_session(
        tmp_path_factory, f"reference-{name}", lambda run_dir: train(run_dir, name)))


def _made_once_per_session(tmp_path_factory, name: str, make) -> Path:
    """``make(folder)`` once for the whole test session, whichever xdist worker asks first
    (the others wait for it under a file lock, then read the same folder): the session's
    shared temporary folder holds it. A folder left unfinished by a failed ``make`` is made
    again."""
    import fcntl
    import shutil

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def reference(reference_runs) -> dict[str, list[float]]:
    """The losses of ``reference_runs``, by name."""
    from test_train_e2e import STEPS, losses_of

    def losses(name: str) -> list[float]:
        out = losses_of(reference_runs[name])
        assert len(out) == STEPS
        return out

    return _OnFirstUse(losses)


@pytest.fixture(scope="session")
def hf_gpt2(tmp_path_factory) -> Path:
    """A tiny random HF GPT-2 directory with its tokenizer (``hf_models.make_hf_dir``: tied,
    seed 0). Tests read it, never write (copy it to change it)."""
    from hf_models import make_hf_dir

    return make_hf_dir(tmp_path_factory.mktemp("hf") / "tied", tied=True)


@pytest.fixture(scope="session")
def hf_imported(hf_gpt2, tmp_path_factory) -> Path:
    """``hf_gpt2`` through ``hybrid-ckpt import``: a model-only checkpoint that carries the
    tokenizer. Tests read it, never write (copy it to damage it)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("imported") / "tied"
    done = subprocess.run([str(Path(sys.executable).parent / "hybrid-ckpt"), "import",
                           str(hf_gpt2), str(out)], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


CPU_LOG = "HYBRID_TEST_CPU_LOG"
"""Where to append each test's CPU seconds (its whole process tree: jobs, fork servers,
workers), one JSON line each, when set: what the suite spends, per test, independent of the
machine's other load (``cpuacct`` of a cgroup v1 per pytest process; Linux, root)."""


def _cpu_cgroup():
    root = Path("/sys/fs/cgroup/cpuacct")
    if not os.environ.get(CPU_LOG) or not root.is_dir():
        return None
    group = root / f"hybrid-tests-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``HYBRID_TEST_CPU_LOG`` set, the test's CPU seconds (setup, call and teardown)
    and wall seconds are appended to that file."""
    import json
    import time

    group = getattr(pytest_runtest_protocol, "group", None)
    if group is None and os.environ.get(CPU_LOG):
        group = pytest_runtest_protocol.group = _cpu_cgroup()
    if group is None:
        yield
        return
    before, start = int((group / "cpuacct.usage").read_text()), time.monotonic()
    yield
    cpu = (int((group / "cpuacct.usage").read_text()) - before) / 1e9
    with open(os.environ[CPU_LOG], "a") as log:
        log.write(json.dumps({"test": item.nodeid, "cpu_s": round(cpu, 2),
                              "wall_s": round(time.monotonic() - start, 2)}) + "\n")


def pytest_unconfigure(config):
    """The CPU log's cgroup goes when its pytest process ends (the process moved out first)."""
    import contextlib

    group = getattr(pytest_runtest_protocol, "group", None)
    if group is not None:
        with contextlib.suppress(OSError):
            (group.parent / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()
