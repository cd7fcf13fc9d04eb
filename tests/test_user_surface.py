"""Small things a user trips on, each through the real commands (#31's sections 4 and 5): a
refused run leaves nothing behind, a search with no layout says why, a text file given as a
token file is called one, hybrid-compare on a resumed run and on a lossy DP option, records
appended whole, and checkpoints that are checked whole before export or resume."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hybrid.planning.config import Config, to_dict

BIN = Path(sys.executable).parent
TRAIN, PLAN, CKPT, COMPARE = (str(BIN / name) for name in
                              ("hybrid-train", "hybrid-plan", "hybrid-ckpt", "hybrid-compare"))
TINY = ["model=tiny", "data=synthetic", "parallel=single", "train.global_batch=4",
        "train.micro_batch=2", "train.log_every=100", "train.timeline_step=0",
        "optim.warmup_steps=0"]

pytestmark = pytest.mark.timeout(120)


def one_line_error(done: subprocess.CompletedProcess, needle: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines


def test_a_refused_run_leaves_no_run_directory(tmp_path):
    done = subprocess.run([TRAIN, "parallel.tp=3"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    one_line_error(done, "parallel.tp=3 does not divide model.heads=4")
    assert list(tmp_path.iterdir()) == []  # no outputs/<date>/<time>/.hydra, no train.log
    done = subprocess.run([TRAIN, "parallel.tp=3", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and not (tmp_path / "run").exists()


def test_a_search_that_finds_no_layout_says_why():
    done = subprocess.run([PLAN, "search.world=7"], capture_output=True, text=True, timeout=60)
    one_line_error(done, "no layout of 7 devices runs this config: ")
    assert "48 invalid train.global_batch; e.g. train.global_batch=16 is not divisible by " \
           "parallel.dp=7" in done.stderr


def test_a_text_file_of_odd_length_is_called_a_text_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("odd")
    done = subprocess.run([TRAIN, "data=tokens", f"data.path={text}",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=60)
    one_line_error(done, f"data.path={text} looks like a text file, not a token file")


def _run_dir(path: Path, losses: dict[int, float], **changes) -> Path:
    config = to_dict(Config())
    for dotted, value in changes.items():
        group, key = dotted.split("__")
        config[group][key] = value
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses.items()))
    return path


def test_hybrid_compare_takes_a_resumed_run_over_its_common_steps(tmp_path):
    losses = {s: 5.0 - 0.1 * s for s in range(1, 7)}
    base = _run_dir(tmp_path / "base", losses)
    resumed = _run_dir(tmp_path / "resumed", {s: losses[s] for s in (4, 5, 6)},
                       checkpoint__resume_from=str(base / "checkpoints" / "step_00000003"))
    done = subprocess.run([COMPARE, str(base), str(resumed)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "overlap in steps 4-6 (one resumed the other's checkpoint)" in done.stdout
    longer = _run_dir(tmp_path / "longer", {**losses, 7: 4.2})  # not a resume: still an error
    done = subprocess.run([COMPARE, str(base), str(longer)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "only the 6 common steps were compared" in done.stderr


def test_hybrid_compare_says_a_lossy_dp_option_is_expected_to_part(tmp_path):
    losses = {s: 5.0 - 0.1 * s for s in range(1, 4)}
    base = _run_dir(tmp_path / "base", losses)
    lossy = _run_dir(tmp_path / "bf16", {s: v * 1.01 for s, v in losses.items()},
                     parallel__dp=2, parallel__dp_compress="bf16")
    done = subprocess.run([COMPARE, str(base), str(lossy)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1  # it parts, and the note says why that is expected
    assert "parallel.dp_compress: none vs bf16): its losses need not match" in done.stdout


def test_a_record_that_does_not_fit_is_not_half_written(tmp_path):
    """A file that cannot grow (here a file-size limit, as a full disk): the record that does
    not fit is cut off again and the error is one line; every line left is a whole record."""
    path = tmp_path / "metrics.jsonl"
    script = textwrap.dedent(f"""
        import resource, signal
        from pathlib import Path
        from hybrid.files import JsonLines, RunDirError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write, do not kill
        lines = JsonLines(Path({str(path)!r}), append=False)
        lines.append({{"step": 1, "pad": "x" * 40}})
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
        try:
            lines.append({{"step": 2, "pad": "x" * 80}})
        except RunDirError as err:
            print(err)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"cannot write {path}" in done.stdout
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]


# ----- checkpoints: checked whole before they are used -------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained")
    done = subprocess.run([TRAIN, *TINY, "train.steps=4", "checkpoint.every=2",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                          timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir / "checkpoints" / "step_00000004"


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``trained`` through ``hybrid-ckpt export``: the plain file and the command's outcome,
    one export for the tests that check the file and that load it."""
    out = tmp_path_factory.mktemp("exported") / "model.pt"
    done = subprocess.run([CKPT, "export", str(trained), str(out)], capture_output=True,
                          text=True, timeout=60)
    return out, done


def _copy(checkpoint: Path, to: Path) -> Path:
    shutil.copytree(checkpoint, to)
    return to


def _flip_byte(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.slow
def test_export_refuses_a_damaged_checkpoint_and_writes_a_plain_file(trained, exported,
                                                                    tmp_path):
    damaged = _copy(trained, tmp_path / "damaged")
    _flip_byte(next(damaged.glob("__0_*.distcp")), 100)
    done = subprocess.run([CKPT, "export", str(damaged), str(tmp_path / "bad.pt")],
                          capture_output=True, text=True, timeout=60)
    one_line_error(done, "does not match the checksum written with it: it is corrupted")
    assert not (tmp_path / "bad.pt").exists()
    model, done = exported
    assert done.returncode == 0 and done.stderr == "", done.stderr  # no torch warning
    umask = os.umask(0)
    os.umask(umask)
    assert model.stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.slow
def test_show_into_a_closed_pipe_ends_quietly(trained):
    """``hybrid-ckpt show RUN | head -1``: the reader goes away before the listing is written.
    Here it is gone before the first byte (the pipe's read end closed at once), so the write
    fails every time, whatever the listing's length: no "Broken pipe", no traceback, and the
    status of a tool killed by SIGPIPE (141), as ``cat`` would end."""
    proc = subprocess.Popen([CKPT, "show", str(trained.parents[1])], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == "", err
    shown = subprocess.run(f"'{CKPT}' show '{trained.parents[1]}' | head -1", shell=True,
                           capture_output=True, text=True, timeout=60)
    assert shown.stderr == "" and len(shown.stdout.splitlines()) == 1, shown


@pytest.mark.slow
def test_a_damaged_metadata_file_is_refused_in_one_line(trained, tmp_path):
    flipped = _copy(trained, tmp_path / "flipped" / "step_00000004")
    _flip_byte(flipped / ".metadata", 50)
    done = subprocess.run([TRAIN, *TINY, "train.steps=6", f"checkpoint.resume_from={flipped}",
                           f"hydra.run.dir={tmp_path / 'run1'}"],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert ".metadata does not match the checksum written with it" in done.stderr
    truncated = _copy(trained, tmp_path / "truncated" / "step_00000004")
    metadata = truncated / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:20])
    done = subprocess.run([TRAIN, *TINY, "train.steps=6", f"checkpoint.resume_from={truncated}",
                           f"hydra.run.dir={tmp_path / 'run2'}"],
                          capture_output=True, text=True, timeout=110)
    one_line_error(done, ".metadata has 20 bytes, the save wrote")


@pytest.mark.slow
def test_a_checkpoint_copied_under_another_name_resumes(trained, tmp_path):
    copy = _copy(trained, tmp_path / "best-model")
    done = subprocess.run([TRAIN, *TINY, "train.steps=5", f"checkpoint.resume_from={copy}",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {copy} (step 4)" in done.stdout


@pytest.mark.parametrize("setting, warning", [
    ("launcher.max_restarts=1",
     "launcher.max_restarts=1 without checkpoint.every: a restarted group starts again from "
     "step 1; set checkpoint.every=N to resume from the newest checkpoint"),
    # nothing would be saved there, and the folder is not checked
    ("checkpoint.dir=/proc/x",
     "checkpoint.dir=/proc/x without checkpoint.every: nothing is saved there; set "
     "checkpoint.every=N to save checkpoints"),
], ids=["restarts", "checkpoint-dir"])
def test_a_setting_that_needs_checkpoints_is_warned_of_without_them(setting, warning,
                                                                     tmp_path):
    """Warned before launch (here the run then stops at a later check, also before launch)."""
    done = subprocess.run([TRAIN, *TINY, "train.steps=1", setting,
                           "checkpoint.resume_from=/nowhere", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[0] == f"warning: {warning}"


@pytest.mark.slow
def test_the_docs_load_an_exported_model_in_a_python_session_of_its_own(trained, exported,
                                                                       tmp_path):
    """docs/checkpoints.md's block, as written: it sets up its own 1-rank process group."""
    model, done = exported
    assert done.returncode == 0, done.stderr
    shutil.copy(model, tmp_path / "model.pt")
    shutil.copy(trained.parent.parent / "config.json", tmp_path / "config.json")
    doc = (Path(__file__).parents[1] / "docs" / "checkpoints.md").read_text()
    block = doc.split("the 1-process model loads it so:\n\n```python\n")[1].split("```")[0]
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("loss ")


@pytest.mark.slow
def test_a_resume_reads_the_data_its_checkpoint_read(tmp_path):
    """The checkpoint records its data (size and edges' hash) and the seed and global batch
    that order it: other data is refused in one line, the same bytes at another path are
    accepted, another order is warned of."""
    import numpy as np

    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint16).tofile(tokens)
    data = ["data=tokens", f"data.path={tokens}"]
    first = tmp_path / "first"
    done = subprocess.run([TRAIN, *TINY, *data, "train.steps=2", "checkpoint.every=2",
                           f"hydra.run.dir={first}"], capture_output=True, text=True,
                          timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    checkpoint = first / "checkpoints" / "step_00000002"

    def resume(name: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([TRAIN, *TINY, "train.steps=3", f"checkpoint.resume_from={checkpoint}",
                               f"hydra.run.dir={tmp_path / name}", *extra],
                              capture_output=True, text=True, timeout=110)

    done = resume("reseeded", *data, "seed=8")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "warning: resuming with seed=8 (the checkpoint's 1234): the data order from here " \
           "on is not the saved run's" in done.stderr
    moved = tmp_path / "moved" / "tokens.bin"  # the same bytes elsewhere: the same data
    moved.parent.mkdir()
    shutil.copy(tokens, moved)
    done = resume("moved", "data=tokens", f"data.path={moved}")
    assert done.returncode == 0, done.stderr[-2000:]
    other = tmp_path / "other.bin"
    np.random.default_rng(1).integers(0, 256, 20_000, dtype=np.uint16).tofile(other)
    done = resume("swapped", "data=tokens", f"data.path={other}")
    one_line_error(done, f"{other} (the checkpoint's {tokens}) has the same size but other "
                         f"contents than then")
    with open(tokens, "r+b") as handle:
        handle.truncate(30_000)
    done = resume("truncated", *data)
    one_line_error(done, f"{tokens} had 40,000 bytes then and has 30,000 now; restore it, or "
                         f"start a new run from the checkpoint's weights with "
                         f"checkpoint.init_from={checkpoint}")


@pytest.mark.slow
def test_a_closed_terminal_stops_the_run_in_one_line(tmp_path):
    """SIGHUP to the whole process group, as a terminal that closes sends it: the launcher
    stops the workers and says so; multiprocessing's helpers, deaf to it, print nothing. As
    promptly as SIGTERM (#43: the agent passed SIGHUP on to workers that ignored it, and they
    lived until its SIGKILL 10 s later): a bound on that failure, loose for a loaded machine."""
    import signal

    # (the straggler warning off: steps of a few ms on a busy machine can name a rank)
    proc = subprocess.Popen([TRAIN, *TINY, "parallel.dp=2", "train.steps=1000",
                             "train.log_every=1", "train.straggler_ratio=0",
                             f"hydra.run.dir={tmp_path}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:  # the first step has run: the workers and helpers are up
            if line.startswith("step "):
                break
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGHUP)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGHUP
    assert err.strip().splitlines() == ["interrupted: launcher got SIGHUP; all 2 workers were "
                                        "stopped"], err[-2000:]
    assert took < 8, f"the run stopped {took:.1f} s after SIGHUP"
