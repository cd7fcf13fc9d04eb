"""Bad input through the real commands: data files, run directories, hybrid-data, a diverging
run, signals and a full disk. Each ends with its exit status and exactly one ``error:`` (or
``interrupted:``) line, no traceback, no process left, no half-written or overwritten file.
Bad config values are the table in ``tests/test_train_cli.py``."""

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from test_train_cli import _alive, _descendants, _wait_for

BIN = Path(sys.executable).parent
TRAIN, DATA = str(BIN / "hybrid-train"), str(BIN / "hybrid-data")
SMALL = ["model=tiny", "data=synthetic", "parallel=single", "parallel.dp=2", "train.global_batch=8",
         "train.timeline_step=0", "optim.warmup_steps=0"]

pytestmark = pytest.mark.timeout(120)


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, **kwargs)


def one_line(done: subprocess.CompletedProcess, code: int, needle: str, prefix="error: "):
    assert done.returncode == code, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if not line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith(prefix) and needle in lines[0], lines


def _text(path: Path) -> Path:
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return path


def _uint16(path: Path) -> Path:
    np.tile(np.arange(200, dtype=np.uint16), 60).tofile(path)
    return path


def _uint32(path: Path) -> Path:
    np.tile(np.arange(200, dtype=np.uint32), 60).tofile(path)
    return path


DATA_CASES = [
    ("text file", _text, "uint16", "looks like a text file, not a token file"),
    ("uint16 read as uint32", _uint16, "uint32", "it was written as uint16; set data.dtype=uint16"),
    ("uint32 read as uint16", _uint32, "uint16", "it was written as uint32; set data.dtype=uint32"),
    ("directory", lambda path: path.mkdir() or path, "uint16", "is a directory"),
]


@pytest.mark.parametrize("name, make, dtype, needle", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_a_file_that_is_not_a_token_file_is_named_before_launch(name, make, dtype, needle,
                                                                 tmp_path):
    path = make(tmp_path / "data.bin")
    run_dir = tmp_path / "run"
    small = [o for o in SMALL if o != "data=synthetic"]
    done = run([TRAIN, *small, "data=tokens", f"data.path={path}", f"data.dtype={dtype}",
                f"hydra.run.dir={run_dir}"])
    one_line(done, 2, needle)
    assert not (run_dir / "workers").exists() and not (run_dir / "config.json").exists()


def test_a_run_directory_that_holds_a_run_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    done = run([TRAIN, *SMALL, f"hydra.run.dir={tmp_path}"])
    one_line(done, 2, "already holds a run (config.json); resume it with "
                      f"checkpoint.resume_from={tmp_path}")
    assert (tmp_path / "config.json").read_text() == '{"a": 1}'
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("where", ["/proc/hybrid-run", "a file"])
def test_a_run_directory_that_cannot_be_made_is_refused(where, tmp_path):
    if where == "a file":
        where = tmp_path / "taken"
        where.write_text("keep me")
    done = run([TRAIN, *SMALL, f"hydra.run.dir={where}"])
    one_line(done, 2, "cannot write the run directory")
    if isinstance(where, Path):
        assert where.read_text() == "keep me"


@pytest.fixture
def small_mount(tmp_path):
    """A 200 KiB tmpfs (root and mount needed; skipped elsewhere), unmounted afterwards."""
    mount = tmp_path / "mnt"
    mount.mkdir()

    def make(options: str) -> Path:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        return mount
    yield make
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_read_only_run_directory_is_refused(small_mount):
    mount = small_mount("ro,size=200k")
    done = run([TRAIN, *SMALL, f"hydra.run.dir={mount}/run"])
    one_line(done, 2, "Read-only file system")


@pytest.mark.slow
def test_a_full_disk_ends_in_one_line_and_leaves_no_half_written_file(small_mount):
    mount = small_mount("size=200k")
    run_dir = mount / "run"
    done = run([TRAIN, *SMALL, "train.steps=4", "checkpoint.every=2",
                f"hydra.run.dir={run_dir}"])
    one_line(done, 2, "No space left on device")
    json.loads((run_dir / "config.json").read_text())  # whole
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
    checkpoints = run_dir / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step_00000002.tmp"]  # never visible
    assert not [p for p in run_dir.rglob(".*.tmp")]


def test_hybrid_data_never_writes_over_its_input_or_an_existing_file(tmp_path):
    text = _text(tmp_path / "in.txt")
    before = text.read_bytes()
    one_line(run([DATA, str(text), str(text)]), 2, "is the input file")
    assert text.read_bytes() == before
    out = tmp_path / "tokens.bin"
    out.write_bytes(b"precious")
    one_line(run([DATA, str(text), str(out)]), 2, "exists; choose another path or pass --force")
    assert out.read_bytes() == b"precious"
    assert run([DATA, str(text), str(out), "--force"]).returncode == 0
    mask = os.umask(0o022)
    os.umask(mask)
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~mask)


def _error_pickles() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("pytorch-errorfile-*")}


@pytest.mark.slow
def test_a_diverging_run_stops_before_applying_a_non_finite_update(tmp_path):
    before = _error_pickles()
    done = run([TRAIN, *SMALL, "train.steps=5", "optim.lr=1e30", "optim.min_lr=0",
                f"hydra.run.dir={tmp_path}"])
    one_line(done, 1, "step 2: loss nan, gradient norm nan; the update was not applied")
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    assert steps == [1]
    # the agent's account of the failure is in the run's log, not on the console
    assert "NonFiniteError" in (tmp_path / "train.log").read_text()
    assert _error_pickles() <= before  # torch.multiprocessing's error files were removed


@pytest.mark.slow
def test_a_warm_up_longer_than_the_run_is_one_warning(tmp_path):
    done = run([TRAIN, *SMALL, "train.steps=2", "optim.warmup_steps=5",
                f"hydra.run.dir={tmp_path}"])
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == ["warning: optim.warmup_steps=5 is longer than train.steps=2: the "
                        "learning rate never reaches optim.lr=0.003"]


def _start(tmp_path, *extra):
    return subprocess.Popen([TRAIN, *SMALL, "train.steps=1000", f"hydra.run.dir={tmp_path}",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, needle", [
    (signal.SIGTERM, 143, "interrupted: launcher got SIGTERM; all 2 workers were stopped"),
    (signal.SIGINT, 130, "interrupted: all 2 workers were stopped"),
])
def test_a_signal_mid_run_stops_every_process_with_one_line(sig, code, needle, tmp_path):
    proc = _start(tmp_path)
    try:
        _wait_for(lambda: (tmp_path / "metrics.jsonl").exists()
                  and (tmp_path / "metrics.jsonl").read_text(), 90, "the first step")
        family = _descendants(proc.pid)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, stderr[-2000:]
    assert stderr.strip().splitlines() == [needle] and "Traceback" not in stderr
    _wait_for(lambda: not any(_alive(pid) for pid in family), 30, "all workers to be gone")


def test_ctrl_c_inside_a_library_cleanup_still_counts_as_ctrl_c():
    """The start-up race behind the test below: Ctrl-C landing in OmegaConf's flag restore
    surfaces as an AttributeError whose context is the KeyboardInterrupt."""
    from launch.launchers.failures import interrupted_by

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'")
    except AttributeError as err:
        assert isinstance(interrupted_by(err), KeyboardInterrupt)
    assert interrupted_by(ValueError("a bug")) is None


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    proc = _start(tmp_path)
    try:
        # As soon as the interpreter loads compiled modules: mid-imports, before any worker.
        _wait_for(lambda: "site-packages" in Path(f"/proc/{proc.pid}/maps").read_text(), 30,
                  "the imports to begin")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert stderr.strip().splitlines() == [
        "interrupted: stopped while no worker was running"], stderr[-2000:]
