"""hybrid-train's promises about failure: bad configs never start a worker, a crashed worker
ends the whole run with a non-zero exit and leaves no process behind."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from refusals import refusal_in_process

TRAIN = str(Path(sys.executable).parent / "hybrid-train")

TWO_NODES = ["launcher.nnodes=2", "launcher.nproc_per_node=4", "launcher.rdzv_endpoint=127.0.0.1:1"]
BAD = [
    (["parallel.cp=3"], "parallel.cp=3 needs model.seq_len=32 divisible by 2*cp=6"),
    (["parallel.tp=3"], "parallel.tp=3 does not divide model.heads=4"),
    (["parallel.pp=8"], "exceeds model.layers=4"),
    (["parallel.dp=0"], "parallel.dp=0 must be an integer >= 1"),
    (["train.global_batch=10"], "train.global_batch=10 is not divisible by parallel.dp=2"),
    (["parallel.vpp=2"], "parallel.vpp=2 needs parallel.schedule=interleaved-1f1b"),
    (["parallel.schedule=interleaved-1f1b"], "needs parallel.vpp >= 2"),
    (["parallel.schedule=interleaved-1f1b", "parallel.vpp=2", "model.layers=8",
      "train.global_batch=12"], "to be a multiple of parallel.pp=2"),
    (["parallel.schedule=pipedream"], "parallel.schedule='pipedream' is unknown"),
    (["parallel.order=tp-pp-xx"], "parallel.order='tp-pp-xx' is not a permutation"),
    (["parallel.zero=4"], "parallel.zero=4 is unknown"),
    (["model.vocab_pad_multiple=1", "model.vocab=255"], "does not divide the padded vocabulary"),
    (["launcher.nproc_per_node=4"], "but the launcher starts 4 processes"),
    (["data=tokens", "data.path=/nonexistent/tokens.bin"], "/nonexistent/tokens.bin"),
    (["train.precision=fp8"], "train.precision='fp8' is unknown"),
    (["data=tokens", "data.path=/nonexistent/tokens.bin", "eval.every=10"],
     "eval.every=10 needs validation data, and data=tokens has none"),
    (["data=indexed", "data.path=/nonexistent/p", "data.split=[1,0,0]", "eval.at_end=true"],
     "data.split=[1,0,0] has no validation part"),
    (["eval.batches=0"], "eval.batches=0 must be an integer >= 1"),
    (["optim.name=sgd"], "optim.name='sgd' is unknown; choose one of adamw"),
    (["optim.lr=-0.1"], "optim.lr=-0.1 must be a finite number >= 0"),
    (["optim.lr=nan"], "optim.lr=nan must be a finite number >= 0"),
    (["optim.lr=inf"], "optim.lr=inf must be a finite number >= 0"),
    (["optim.min_lr=0.01"], "optim.min_lr=0.01 is above optim.lr=0.003"),
    (["optim.eps=0"], "optim.eps=0.0 must be a finite number > 0"),
    (["optim.beta2=1.0"], "optim.beta2=1.0 must be in [0, 1)"),
    (["train.grad_clip=nan"], "train.grad_clip=nan must be a finite number >= 0"),
    (["model.init_std=-1"], "model.init_std=-1.0 must be a finite number > 0"),
    (["model.norm_eps=0"], "model.norm_eps=0.0 must be a finite number > 0"),
    (["parallel.bucket_mb=inf"], "parallel.bucket_mb=inf must be a finite number > 0"),
    (["launcher.omp_threads=0"], "launcher.omp_threads=0 must be an integer >= 1"),
    (["launcher.max_restarts=-1"], "launcher.max_restarts=-1 must be a finite number >= 0"),
    (["checkpoint.every=-5"], "checkpoint.every=-5 must be a finite number >= 0"),
    (["data=synthetic", "data.samples=0"], "data.samples=0 must be an integer >= 1"),
    (["model=gpt2-350m", "parallel.dp=4", "parallel.tp=2", "parallel.pp=1",
      "train.global_batch=16"], " would need "),  # which fix: the host's free memory
    (["launcher.nnodes=2"], "launcher=local runs one node, not launcher.nnodes=2; use "
                            "launcher=torchrun on each node"),
    (["launcher=torchrun", "launcher.nnodes=2", "launcher.node_rank=2",
      "launcher.rdzv_endpoint=127.0.0.1:1"], "launcher.node_rank=2 must be in 0..1"),
    (["parallel.tpp=2"], "Key 'tpp' not in 'ParallelConfig'"),
    (["model=tinyy"], "Could not find 'model/tinyy'; choose one of: gpt-1t, gpt2-1.3b"),
    (["seed=99999999999999999999"], "seed=99999999999999999999 must be an integer in "
                                    "0..9,223,343,366,818"),
    (["launcher=slurm", "launcher.time_min=soon"],
     "launcher.time_min=soon: launcher.time_min takes an integer; write a whole number "
     "(launcher.time_min=N)"),
    # a float for an integer setting: the field and the integer to write
    (["train.steps=1e3"], "train.steps=1e3: train.steps takes an integer, and this reads as "
                          "the float 1000.0; write train.steps=1000"),
    (["model.layers=2.0"], "model.layers=2.0: model.layers takes an integer, and this reads "
                           "as the float 2.0; write model.layers=2"),
    (["model.kv_heads=2.0"], "write model.kv_heads=2"),
    (["train.steps=2.5"], "train.steps=2.5: train.steps takes an integer, not 2.5; write "
                          "train.steps=2 or train.steps=3"),
    (["launcher=slurm", "launcher.cpus_per_task=0"],
     "launcher.cpus_per_task=0 must be an integer >= 1"),
    (["launcher=slurm", "launcher.rdzv_endpoint=n1:29500"],
     "launcher=slurm places the nodes itself"),
    # launcher.min_nodes (#41): refused before any node waits for the others
    (["launcher=torchrun", *TWO_NODES, "launcher.min_nodes=3", "checkpoint.every=2",
      "checkpoint.dir=/tmp"], "launcher.min_nodes=3 must be in 1..launcher.nnodes=2"),
    (["launcher=torchrun", *TWO_NODES, "launcher.min_nodes=1"],
     "launcher.min_nodes=1 needs checkpoint.every > 0"),
    (["launcher=torchrun", *TWO_NODES, "launcher.min_nodes=1", "checkpoint.every=2",
      "checkpoint.dir=/tmp", "parallel.tp=8", "parallel.dp=1", "parallel.pp=1"],
     "a TP group spans nodes"),
    (["launcher=torchrun", "launcher.nnodes=2", "launcher.nproc_per_node=1",
      "launcher.rdzv_endpoint=127.0.0.1:1", "launcher.min_nodes=1", "checkpoint.every=2",
      "checkpoint.dir=/tmp", "parallel.schedule=interleaved-1f1b", "parallel.vpp=2",
      "parallel.dp=1", "parallel.tp=1", "model.layers=8"],
     "launcher.min_nodes=1: no layout of the config fits 1 node(s) x 1 ranks"),
    (["launcher.min_nodes=1"], "launcher.min_nodes=1 is for jobs of several nodes"),
    # parallel.dp_balance (#40)
    (["parallel.dp_balance=fast"], "parallel.dp_balance='fast' is unknown; choose one of even"),
    (["parallel.dp_balance=dynamic", "parallel.dp_balance_every=0"],
     "parallel.dp_balance_every=0 must be an integer >= 1"),
    (["parallel.dp_balance=dynamic", "parallel.dp_compress=powersgd"],
     "parallel.dp_balance=dynamic cannot run with parallel.dp_compress=powersgd"),
    (["parallel.dp_balance=dynamic", "parallel.zero=3"],
     "parallel.dp_balance=dynamic with parallel.zero=3 needs parallel.pp=1"),
]

# One of each kind of refusal (a validation rule, Hydra's composition of a key, a preset and a
# type, a launcher's rule, the data, the memory check, a value's range) also goes through the
# real command, which must say exactly what the in-process check says.
THROUGH_THE_COMMAND = ["parallel.tp=3", "parallel.tpp=2", "model=tinyy", "launcher.nnodes=2",
                       "launcher=slurm launcher.time_min=soon", "data=tokens data.path=/nonexistent/tokens.bin",
                       "model=gpt2-350m parallel.dp=4 parallel.tp=2 parallel.pp=1 train.global_batch=16",
                       "seed=99999999999999999999", "train.steps=1e3"]

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("overrides, needle", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_is_refused_in_one_line_before_anything_is_written(overrides, needle,
                                                                       tmp_path):
    line = refusal_in_process(["model=tiny", *overrides], tmp_path)
    assert needle in line and "\n" not in line, line
    assert not any(tmp_path.iterdir())  # no config.json, no plan.json, no worker directory


@pytest.mark.parametrize("case", THROUGH_THE_COMMAND)
def test_bad_config_exits_2_with_the_same_line_and_starts_no_worker(case, tmp_path):
    overrides = case.split()
    assert any(o == overrides for o, _ in BAD), case  # a case of BAD, checked in-process too
    expected = refusal_in_process(["model=tiny", *overrides], tmp_path / "in-process")
    done = subprocess.run([TRAIN, "model=tiny", f"hydra.run.dir={tmp_path / 'run'}", *overrides],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    # The host's free memory moves meanwhile, and with it the fix the memory check suggests.
    free = re.compile(r"available to the ranks of one node is .*")
    assert [free.sub("...", line) for line in done.stderr.strip().splitlines()] == [
        free.sub("...", expected)], done.stderr
    assert not (tmp_path / "run").exists()  # the launcher never ran; nothing was kept


UNWRITABLE = [
    ("checkpoint.dir=/proc/hybrid-no/ck",
     "checkpoint.dir=/proc/hybrid-no/ck cannot be created or written: No such file or "
     "directory (/proc/hybrid-no); choose another with checkpoint.dir=..."),
    ("checkpoint.dir={tmp}/a-file/ck",
     "checkpoint.dir={tmp}/a-file/ck cannot be created or written: Not a directory; choose "
     "another with checkpoint.dir=..."),
    ("hydra.run.dir=/proc/hybrid-no/run",
     "cannot write the run directory: [Errno 2] No such file or directory: '/proc/hybrid-no'; "
     "choose another with hydra.run.dir=..."),
]


@pytest.mark.slow
@pytest.mark.parametrize("override, expected", UNWRITABLE, ids=["proc", "file", "run-dir"])
def test_a_directory_that_cannot_be_made_is_one_line_before_launch(override, expected,
                                                                    tmp_path):
    """#43: a checkpoint directory under /proc ended in mkdir's traceback on rank 0 after
    the workers started; now it is refused before launch, and the probe leaves nothing."""
    (tmp_path / "a-file").write_text("not a directory")
    run_dir = tmp_path / "run"
    override = override.format(tmp=tmp_path)
    done = subprocess.run([TRAIN, "model=tiny", "data=synthetic", "checkpoint.every=1",
                           f"hydra.run.dir={run_dir}", override],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == [f"error: {expected.format(tmp=tmp_path)}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no run, no probe


def _fork_servers(tag: str) -> set[int]:
    """multiprocessing fork servers on this machine whose environment carries ``tag`` (so
    those of tests running beside this one, or of other work, are not counted)."""
    found, marker = set(), f"HYBRID_TEST_TAG={tag}".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (b"multiprocessing.forkserver" in (proc / "cmdline").read_bytes()
                    and marker in (proc / "environ").read_bytes().split(b"\0")):
                found.add(int(proc.name))
        except OSError:
            pass  # gone meanwhile
    return found


def test_a_run_refused_after_its_fork_server_started_ends_it(tmp_path):
    """hybrid-train starts its workers' fork server as soon as the config passes its checks
    (the server's imports overlap the rest of the preparation); a run refused after that, here
    for its data, must not leave the server importing on its own."""
    tag = str(tmp_path)
    with open(tmp_path / "stderr", "w") as err:  # a file: a pipe would wait for the server
        code = subprocess.run([TRAIN, "model=tiny", "data=indexed",
                               f"data.path={tmp_path / 'missing'}",
                               f"hydra.run.dir={tmp_path / 'run'}"],
                              env={**os.environ, "HYBRID_TEST_TAG": tag},
                              stdout=subprocess.DEVNULL, stderr=err, timeout=60).returncode
    assert code == 2, (tmp_path / "stderr").read_text()
    assert "missing.idx does not exist" in (tmp_path / "stderr").read_text()
    deadline = time.monotonic() + 2  # its imports alone take longer than this
    while _fork_servers(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _fork_servers(tag)


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            children = (task / "children").read_text().split() if task.exists() else []
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)  # polling a condition with a deadline, not synchronising on time
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_killed_worker_ends_the_run_with_its_rank_and_no_leftovers(tmp_path):
    proc = subprocess.Popen([TRAIN, "model=tiny", "data=synthetic", "train.steps=1000",
                             f"hydra.run.dir={tmp_path}",
                             "train.timeline_step=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (tmp_path / "metrics.jsonl").exists()
                  and (tmp_path / "metrics.jsonl").read_text(), 90, "the first step")
        family = _descendants(proc.pid)
        # Workers are the launcher's grandchildren (children of its fork server).
        workers = [pid for pid in family if _parent_of(pid) != proc.pid]
        assert len(workers) >= 8, workers
        os.kill(workers[len(workers) // 2], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr[-2000:]
    assert re.search(r"^error: rank \d failed: killed by signal SIGKILL", stderr, re.M), stderr
    _wait_for(lambda: not any(_alive(pid) for pid in family), 30, "all workers to be gone")


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_worker_behind(tmp_path):
    proc = subprocess.Popen([TRAIN, "model=tiny", "data=synthetic", "train.steps=1000",
                             f"hydra.run.dir={tmp_path}",
                             "train.timeline_step=0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: (tmp_path / "metrics.jsonl").exists()
                  and (tmp_path / "metrics.jsonl").read_text(), 90, "the first step")
        family = _descendants(proc.pid)
        assert len(family) >= 9, family  # the fork server and 8 workers
        proc.kill()  # SIGKILL: the launcher can clean nothing up itself
        proc.wait(timeout=10)
        _wait_for(lambda: not any(_alive(pid) for pid in family), 10,
                  "every worker to notice its launcher's death")
    finally:
        proc.kill()
        for pid in _descendants(proc.pid) if _alive(proc.pid) else ():
            os.kill(pid, signal.SIGKILL)
